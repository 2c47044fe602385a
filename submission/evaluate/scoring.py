"""Numbers from outputs: sacreBLEU scores with signatures, throughput, repeat statistics,
the Pareto frontier."""
from __future__ import annotations

import statistics


def score(hyps: list[str], refs: list[list[str]], tgt_lang: str | None = None) -> dict:
    """refs: one list per reference stream (sacreBLEU's layout). Scores are rounded as the
    CLI prints them, so they compare equal to `sacrebleu REF -i HYP -m bleu chrf`."""
    from sacrebleu.metrics import BLEU, CHRF
    bleu = BLEU(trg_lang=tgt_lang or "")
    chrf = CHRF()
    b, c = bleu.corpus_score(hyps, refs), chrf.corpus_score(hyps, refs)
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2),
            "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature())}


def source_words(lines: list[str]) -> int:
    # whitespace words of the source: the unit of the WMT efficiency findings' words/s
    return sum(len(x.split()) for x in lines)


def target_pieces(spm_path: str, hyps: list[str]) -> int:
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=spm_path)
    return sum(len(p) for p in sp.encode(hyps))


def spread(values: list[float]) -> dict:
    """Median and spread of repeats: min, max and (max - min) / median."""
    if not values:
        return {}
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values), "n": len(values),
            "rel_spread": (max(values) - min(values)) / med if med else 0.0}


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict:
    import numpy as np
    if not values:
        return {}
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def pareto_frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (speed, quality) that no other point beats on both axes,
    ordered by speed. A point equal to another on both axes keeps only its first copy."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1], i))
    front, best = [], float("-inf")
    for i in order:  # fastest first: a point is on the frontier if it is better than all faster ones
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return sorted(front, key=lambda i: points[i][0])
