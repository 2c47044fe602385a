"""The engines we compare against, on the same weights: CTranslate2 and Hugging Face
transformers (converted by tools/convert/). Each `*_translator` loads once and
returns translate(lines) -> hypotheses with our own text pipeline around it, so
only the search engines differ (submission/evaluate times loading and work apart).

CTranslate2 runs as its performance guide tells users (docs/performance.md,
docs/parallel.md of CTranslate2): int8; for throughput `inter_threads` = cores with
`intra_threads` 1 and the input split into token-sized batches submitted together,
so its workers decode batches in parallel; the vocabulary mapping (`use_vmap`,
vmap.txt) built from our lexical shortlist whenever our row uses it. One `CT2Run`
says how; `ct2_runs` lists the configurations of each benchmark group.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from decoder import modeldir
from decoder.pipeline import NormalisePool, Text

from .convert import max_decoding_length, to_hf

VMAP = "vmap.txt"  # the name CTranslate2's converter gives --vocab_mapping in a model dir


def _text(model_dir, processes: int = 0):
    """The model's text pipeline; `processes` > 0: its normaliser in that many worker processes, as
    our decoder's on a GPU machine (switch normalise_processes), so the engines' text costs match."""
    cfg, _, spm_path = modeldir.load(model_dir)
    text = Text(cfg, spm_path, cfg.arch.max_positions)
    if processes > 0 and cfg.normaliser:
        text.pool = NormalisePool.shared(cfg, processes)
    return cfg, text


@dataclass(frozen=True)
class CT2Run:
    """One way of running CTranslate2: the Translator's and translate_batch's settings."""
    compute_type: str = "int8"
    beam: int = 1
    inter_threads: int = 1     # batches decoded in parallel, each by one worker
    intra_threads: int = 1     # threads inside one batch's ops
    max_batch_size: int = 4096  # in batch_type units
    batch_type: str = "tokens"
    use_vmap: bool = False     # vocabulary mapping (vmap.txt in the CT2 dir, from our shortlist)
    batch1: bool = False       # one sentence per call (latency), each with its own cap
    one_cap: bool = False      # the longest sentence's cap for all (CT2's plain use: bigger batches, more words)

    def label(self) -> str:
        search = "greedy" if self.beam == 1 else f"beam {self.beam}"
        if self.batch1:
            how = f"batch 1, {self.intra_threads} thread"
        else:
            how = f"inter_threads {self.inter_threads}, intra_threads {self.intra_threads}"
        return (f"CTranslate2 {self.compute_type} {search}, {how}" + (", vmap" if self.use_vmap else "")
                + (", one cap (the longest sentence's)" if self.one_cap else ""))


def ct2_runs(group: str, cores: int, max_tokens: int = 4096, vmap: bool = False) -> list[CT2Run]:
    """The CT2 configurations of a benchmark group; the fastest is the group's denominator.
    throughput / beam4: every core, as parallel 1-thread workers (the guide's advice for
    throughput) and as one multi-threaded worker; batch1: one thread, one sentence a call.
    With `vmap` (our shortlist rows exist) each configuration also runs with use_vmap. Throughput
    and beam 4 add the guide's row with one cap for the whole input, as CT2 is plainly used: larger
    batches than one call per cap, but longer outputs where a sentence runs into its cap (output
    words/s)."""
    if group == "batch1":
        base = [CT2Run(batch1=True)]
    else:
        beam = 4 if group == "beam4" else 1
        base = [CT2Run(beam=beam, inter_threads=cores, max_batch_size=max_tokens)]
        if cores > 1:
            base.append(CT2Run(beam=beam, intra_threads=cores, max_batch_size=max_tokens))
    runs = base + ([replace(r, use_vmap=True) for r in base] if vmap else [])
    return runs + ([] if group == "batch1" else [replace(runs[len(base) if vmap else 0], one_cap=True)])


def write_vmap(ct2_dir: str, model_dir: str) -> str:
    """vmap.txt in a CT2 dir from the model dir's lexical shortlist, in CTranslate2's format:
    `src_piece<TAB>tgt pieces` per source token with a list, and one line with an empty
    source for the ids every batch may produce (our `frequent` and </s>)."""
    cfg, text = _text(model_dir)
    offsets, ids, frequent = modeldir.read_shortlist(model_dir, cfg)
    piece = text.sp.id_to_piece
    off, ids = offsets.tolist(), ids.tolist()
    always = list(dict.fromkeys(frequent.tolist() + [cfg.eos_id]))
    lines = ["\t" + " ".join(piece(t) for t in always)]
    for s in range(len(off) - 1):
        if off[s + 1] > off[s]:
            lines.append(piece(s) + "\t" + " ".join(piece(t) for t in ids[off[s]:off[s + 1]]))
    path = os.path.join(ct2_dir, VMAP)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def cap_groups(toks: list[list[str]], max_positions: int) -> dict[int, list[int]]:
    """{max_decoding_length: indices into toks}: CT2 takes one cap per call, our decoder one
    per sentence, so each call gets the sentences of one cap and both cap every sentence alike."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(toks):
        groups.setdefault(max_decoding_length(len(t), max_positions), []).append(i)
    return groups


def ct2_translator(ct2_dir, model_dir, run: CT2Run, device="cpu", text_processes: int = 0):
    """Load once; return translate(lines) -> hypotheses (submission/evaluate times the two apart).
    Pieces go in and come out as lists through SentencePiece (a Python call per token cost 0.2 s
    for 10,000 lines, more than a tenth of a fast GPU pass). `text_processes`: see `_text`."""
    import ctranslate2
    cfg, text = _text(model_dir, text_processes)
    if run.use_vmap and not os.path.isfile(os.path.join(ct2_dir, VMAP)):
        write_vmap(ct2_dir, model_dir)
    tr = ctranslate2.Translator(ct2_dir, device=device, compute_type=run.compute_type,
                                inter_threads=run.inter_threads, intra_threads=run.intra_threads)
    piece, P = text.sp.id_to_piece, cfg.arch.max_positions  # piece(list of ids) -> list of pieces
    kw = dict(beam_size=run.beam, min_decoding_length=0, max_input_length=P, use_vmap=run.use_vmap)

    def go(ls):
        srcs = text.encode(ls)
        idx = [i for i, s in enumerate(srcs) if s]
        toks = [piece(srcs[i][:-1]) for i in idx]  # the CT2 dir appends </s> (add_source_eos)
        res = [None] * len(toks)
        if run.batch1:
            for j, t in enumerate(toks):
                res[j] = tr.translate_batch([t], max_decoding_length=max_decoding_length(len(t), P), **kw)[0]
        else:
            groups = cap_groups(toks, P)
            if run.one_cap:
                groups = {max(groups, default=1): list(range(len(toks)))}
            # every cap group submitted at once, so the inter_threads workers always have batches
            pending = [(js, tr.translate_batch([toks[j] for j in js], max_batch_size=run.max_batch_size,
                                               batch_type=run.batch_type, max_decoding_length=cap,
                                               asynchronous=True, **kw))
                       for cap, js in groups.items()]
            for js, futures in pending:
                for j, f in zip(js, futures):
                    res[j] = f.result()
        out = [""] * len(ls)
        dec = text.decode([r.hypotheses[0] for r in res])  # SentencePiece decodes pieces as it does ids
        for i, s in zip(idx, dec):
            out[i] = s
        return out
    return go


def fastest(go, lines, passes: int = 1, warm: int | None = 8):
    """(outputs, seconds): the fastest of `passes` timed passes of go(lines) after a warm-up
    on the first `warm` lines (None: all of them): allocator, oneDNN primitive caches,
    CT2's first-call setup."""
    return alternating([go], lines, passes, warm)[0]


def alternating(gos, lines, passes: int = 1, warm: int | None = 8) -> list[tuple[list, float]]:
    """[(outputs, seconds)] of each of `gos`, all warmed up first (on the first `warm`
    lines; None: all), then timed in alternating passes, the fastest of `passes` each: a
    slow spell of a shared machine meets every engine alike, where rows timed one after
    the other can each meet a different one."""
    for go in gos:
        go(lines[:warm])
    outs, best = [None] * len(gos), [float("inf")] * len(gos)
    for _ in range(passes):
        for i, go in enumerate(gos):
            t = time.perf_counter()
            outs[i] = go(lines)
            best[i] = min(best[i], time.perf_counter() - t)
    return list(zip(outs, best))


def run_ct2(ct2_dir, model_dir, lines, run: CT2Run, passes: int = 1):
    """(outputs, seconds): the fastest of `passes` timed passes after a warm-up."""
    return fastest(ct2_translator(ct2_dir, model_dir, run), lines, passes)


def hf_translator(model_dir, threads, batch=64, beam=1, device="cpu", half=False, text_processes: int = 0):
    """Load once; return translate(lines) -> hypotheses. `half`: fp16 weights (a GPU's);
    `text_processes`: see `_text`."""
    import torch
    torch.set_num_threads(threads)
    model, cfg = to_hf(model_dir)
    model = (model.half() if half else model).to(device)
    _, text = _text(model_dir, text_processes)

    def go(ls):
        srcs = text.encode(ls)
        idx = sorted((i for i, s in enumerate(srcs) if s), key=lambda i: -len(srcs[i]))
        out = [""] * len(ls)
        for b in range(0, len(idx), batch):
            chunk = idx[b:b + batch]
            S = max(len(srcs[i]) for i in chunk)
            ids = torch.full((len(chunk), S), cfg.pad_id)
            for r, i in enumerate(chunk):
                ids[r, :len(srcs[i])] = torch.tensor(srcs[i])
            with torch.inference_mode():
                ids = ids.to(device)
                g = model.generate(ids, attention_mask=ids != cfg.pad_id, num_beams=beam, do_sample=False,
                                   max_new_tokens=min(int(S * 1.5 + 10), cfg.arch.max_positions - 1),
                                   min_length=0, decoder_start_token_id=cfg.decoder_start_id,
                                   eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id)
            hyps = []
            for row in g[:, 1:].tolist():
                row = row[:row.index(cfg.eos_id)] if cfg.eos_id in row else row
                hyps.append([t for t in row if t != cfg.pad_id])
            for i, s in zip(chunk, text.decode(hyps)):
                out[i] = s
        return out
    return go


def run_hf(model_dir, lines, threads, batch=64):
    go = hf_translator(model_dir, threads, batch)
    go(lines[:8])
    t = time.perf_counter()
    out = go(lines)
    return out, time.perf_counter() - t
