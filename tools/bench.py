"""Ablation benchmark: naive PyTorch -> each optimisation in turn -> HF and CTranslate2
on the same weights (TenTrans-style table), plus a batch-1 latency comparison.

    python -m tools.bench --model DIR [--input FILE --ref FILE] [--repeat K] [--threads N]

Every row translates the same lines end to end (normalise, SPM, search, detokenise)
with the same thread count; CTranslate2's CPU ISA is pinned (CT2_FORCE_CPU_ISA)
so runs compare. Writes docs/bench/<name>.md and .json with the machine described.
A model dir with a lexical shortlist (python -m student.shortlist) adds the
"+ lexical shortlist" rows, greedy and beam 4, beside the same rows without it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import contextmanager

from decoder import cliargs, textio
from decoder.cliargs import nonneg_int, positive_int
from decoder.optimisations import all_off, describe, group
from decoder.quant import int8_pays
from decoder.translator import Translator

from .baselines import _text, run_ct2, run_hf
from .convert import to_ctranslate2
from .machine import cpu_info, ct2_isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(ROOT, "tests", "fixtures", "bible-tiny")


def read(path: str) -> list[str]:
    return textio.read_file(path)  # the kit's one reader: b"\n" only, as the decoder reads


def add_test_set_args(p) -> None:
    """The test-set options the interleaved benches (bench_fused, bench_gpu) share."""
    p.add_argument("--model", required=True)
    p.add_argument("--src", default=os.path.join(DEFAULT_DATA, "test.en"), help="source lines")
    p.add_argument("--ref", default=None, help="reference lines (default: --src with .es for .en)")
    p.add_argument("--lines", type=nonneg_int, default=0, help="first N lines only (0 = all)")
    p.add_argument("--passes", type=positive_int, default=3, help="timed passes; the fastest counts")


def read_test_set(a) -> tuple[list[str], list[str]]:
    """(source lines, reference lines) of add_test_set_args' options."""
    src, ref = read(a.src), read(a.ref or a.src[:-3] + ".es")
    return (src[:a.lines], ref[:a.lines]) if a.lines else (src, ref)


def scores(hyps, refs) -> tuple[float, float]:
    import sacrebleu
    return (round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
            round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2))


# -- engines: each returns (hypotheses, seconds) for the whole input ------------------------

def run_ours(model_dir, lines, threads, passes: int = 1, **kw):
    """(outputs, seconds): the fastest of `passes` timed passes after a warm-up."""
    tr = Translator(model_dir, threads=threads, **kw)
    tr.translate(lines[:8])  # warm-up: allocator, oneDNN primitive caches
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        out = tr.translate(lines)
        best = min(best, time.perf_counter() - t)
    return out, best


# -- the table -------------------------------------------------------------------------------

NAIVE = dict(all_off(), beam=4, precision="fp32")  # every switch of decoder/optimisations.py off


def ablation() -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(cumulative fp32 rows, variant rows), generated from the registry. Each
    cumulative row adds one "ladder" optimisation to the previous one; each
    variant is the last cumulative row with one precision change or one fused
    kernel, so the table shows what each does on this CPU (on an AVX2-only CPU
    int8 and bf16 are slower than fp32) and the best configuration is picked by
    measurement, not assumed."""
    rows, cur = [("naive PyTorch (beam 4, no cache, unsorted, fp32)", dict(NAIVE))], dict(NAIVE)
    for o in group("ladder"):
        cur = {**cur, o.name: True, **o.row}
        rows.append((f"+ {o.label}", dict(cur)))
    variants = [("+ bf16 weights and activations", {**cur, "precision": "bf16"}),
                ("+ int8 dynamic (PyTorch ops)", {**cur, "precision": "int8"})]
    variants += [(f"+ int8 dynamic, {o.label}", {**cur, "precision": "int8", o.name: True}) for o in group("int8")]
    step = group("step")
    variants += [(f"+ {o.label}", {**cur, o.name: True}) for o in step]
    variants.append((f"+ all of {', '.join(o.name for o in step)}", {**cur, **{o.name: True for o in step}}))
    variants += [(f"+ {o.label}", {**cur, o.name: True}) for o in group("greedy")]
    return rows, variants


def beam_rows(best: dict) -> list[tuple[str, dict]]:
    """Beam 4 from the best greedy configuration, then each beam kernel added in turn."""
    tag, cur = describe(best), {**best, "beam": 4}
    rows = [(f"best ({tag}), beam 4", dict(cur))]
    for o in group("beam"):
        cur = {**cur, o.name: True}
        rows.append((f"best ({tag}), beam 4, + {o.label}", dict(cur)))
    return rows


def pick_best(rows: list[tuple[float, float | None, dict]], max_bleu_loss: float = 0.2) -> dict:
    """The fastest of (words/s, BLEU, config) greedy rows that stays within
    `max_bleu_loss` BLEU of the best-optimised fp32 row (the last fp32 one)."""
    fp32 = [b for _, b, kw in rows if kw["precision"] == "fp32" and b is not None]
    ok = [r for r in rows if not fp32 or r[1] is None or r[1] >= fp32[-1] - max_bleu_loss]
    return max(ok, key=lambda r: r[0])[2]


def slow_here(kw: dict, flags: list[str]) -> bool:
    """A precision this CPU runs far slower than fp32: time it on a subset only."""
    if kw.get("precision") == "int8":
        return not int8_pays()
    if kw.get("precision") == "bf16":
        return not any(f in flags for f in ("avx512_bf16", "amx_bf16"))
    return False


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    p.add_argument("--model", default=os.path.join(DEFAULT_DATA, "model"))
    cliargs.alias(p, "--input", p.add_argument(
        "--src", default=None, help="source lines (default: test.en next to the model: the Bible test split "
                                    "of tests/fixtures/bible-tiny)"))
    p.add_argument("--ref", default=None, help="reference lines for BLEU/chrF (default: test.es next to the "
                                               "model when --src is not given)")
    p.add_argument("--lines", type=nonneg_int, default=0, help="use the first N lines (0 = all)")
    cliargs.alias(p, "--repeat", p.add_argument(
        "--repeat-input", dest="repeat", type=positive_int, default=1, metavar="K",
        help="synthetic larger input: the input K times"))
    p.add_argument("--passes", type=positive_int, default=1,
                   help="timed passes per configuration of ours; the fastest counts (noise on shared machines)")
    p.add_argument("--naive-lines", type=nonneg_int, default=100,
                   help="the naive rows are slow: time them on the first N lines only")
    p.add_argument("--threads", type=positive_int, default=2)
    cliargs.alias(p, "--max-tokens", p.add_argument(
        "--max-batch-tokens", dest="max_tokens", type=positive_int, default=4096, metavar="N",
        help="padded source tokens per batch"))
    p.add_argument("--ct2-isa", default=None, help="CT2_FORCE_CPU_ISA (default: best the CPU has)")
    p.add_argument("--skip", default="", help="comma list of: naive,hf,ct2,batch1")
    p.add_argument("--profile", action="store_true",
                   help="also profile the best configuration (top ops) into PREFIX-profile.txt")
    p.add_argument("--out", metavar="PREFIX", default=None,
                   help="write PREFIX.md and PREFIX.json (default: docs/bench/bench-<model dir name>)")
    # the old way to say --out, kept for scripts: --out-dir DIR --name NAME = --out DIR/NAME
    p.add_argument("--name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def out_prefix(a: argparse.Namespace) -> str:
    """--out, or the old --out-dir DIR / --name NAME, or docs/bench/bench-<model dir name>."""
    return a.out or os.path.join(a.out_dir or os.path.join(ROOT, "docs", "bench"),
                                 a.name or f"bench-{os.path.basename(os.path.abspath(a.model))}")


def main(argv=None):
    a = parse_args(argv)

    machine = cpu_info()
    isa = a.ct2_isa or ct2_isa(machine["flags"])
    os.environ["CT2_FORCE_CPU_ISA"] = isa  # before ctranslate2 is imported
    import torch
    torch.set_num_threads(a.threads)
    machine.update(torch=torch.__version__, torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   threads=a.threads, ct2_isa=isa, python=platform.python_version(),
                   load_avg_at_start=os.getloadavg()[0], timing_passes=a.passes)
    try:
        import ctranslate2
        machine["ctranslate2"] = ctranslate2.__version__
    except ImportError:
        ctranslate2 = None
    model_base = os.path.dirname(os.path.abspath(a.model))
    src_path = a.src or os.path.join(model_base, "test.en")
    ref_path = a.ref or (os.path.join(model_base, "test.es") if a.src is None else None)
    src = read(src_path)
    ref = read(ref_path) if ref_path and os.path.exists(ref_path) else None
    if a.lines:
        src, ref = src[:a.lines], ref[:a.lines] if ref else None
    lines, refs = src * a.repeat, (ref * a.repeat if ref else None)
    skip = set(filter(None, a.skip.split(",")))
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['flags'])}; "
          f"torch {machine['torch']} ({machine['torch_cpu_capability']}), {a.threads} threads, "
          f"CT2 ISA {isa}", file=sys.stderr)
    print(f"input: {src_path} ({len(src)} lines x {a.repeat})", file=sys.stderr)

    cfg, text = _text(a.model)  # token counting only
    n_src_words = lambda ls: sum(len(s.split()) for s in ls)  # noqa: E731
    n_tgt_tokens = lambda hs: sum(len(x) for x in text.sp.encode(hs))  # noqa: E731

    rows = []

    def record(name, hyps, secs, sub):
        r = {"config": name, "lines": len(sub), "seconds": round(secs, 3),
             "src_words_per_s": round(n_src_words(sub) / secs, 1),
             "tgt_tokens_per_s": round(n_tgt_tokens(hyps) / secs, 1)}
        if refs:
            r["bleu"], r["chrf"] = scores(hyps, refs[:len(hyps)])
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)

    has_shortlist = cfg.shortlist is not None  # rows with the switch only where there is a file
    cumulative, variants = ablation()
    full = []  # (words/s, BLEU, kw) of greedy rows timed on the whole input: candidates for "best"
    for name, kw in cumulative + variants:
        naive_row = not kw.get("cache", True)
        if naive_row and "naive" in skip:
            continue
        sub = lines[:a.naive_lines] if (naive_row or slow_here(kw, machine["flags"])) and a.naive_lines else lines
        hyps, secs = run_ours(a.model, sub, a.threads, a.passes, max_tokens=a.max_tokens, **kw)
        record(name + (f" [first {len(sub)} lines]" if len(sub) < len(lines) else ""), hyps, secs, sub)
        if len(sub) == len(lines) and kw["beam"] == 1:
            full.append((rows[-1]["src_words_per_s"], rows[-1].get("bleu"), kw))
    best = pick_best(full)
    tag = describe(best)
    machine["best_config"] = {k: v for k, v in best.items()}
    if has_shortlist:
        hyps, secs = run_ours(a.model, lines, a.threads, a.passes, max_tokens=a.max_tokens,
                              **{**best, "shortlist": True})
        record(f"best ({tag}) + lexical shortlist", hyps, secs, lines)
    for name, kw in beam_rows(best):
        hyps, secs = run_ours(a.model, lines, a.threads, a.passes, max_tokens=a.max_tokens, **kw)
        record(name, hyps, secs, lines)
    if has_shortlist:
        hyps, secs = run_ours(a.model, lines, a.threads, a.passes, max_tokens=a.max_tokens,
                              **{**best, "beam": 4, "shortlist": True})
        record(f"best ({tag}), beam 4, + lexical shortlist", hyps, secs, lines)
    if "hf" not in skip:
        hyps, secs = run_hf(a.model, lines, a.threads)
        record("HF transformers M2M100, greedy, fp32", hyps, secs, lines)
    ct2_int8 = None
    if ctranslate2 is not None and "ct2" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            ct2_dir = to_ctranslate2(a.model, os.path.join(tmp, "ct2"))
            for ct, beam in (("float32", 1), ("int8", 1), ("int8", 4)):
                hyps, secs = run_ct2(ct2_dir, a.model, lines, a.threads, ct, beam, a.max_tokens)
                record(f"CTranslate2 {ct}, {'greedy' if beam == 1 else f'beam {beam}'}", hyps, secs, lines)
                if ct == "int8" and beam == 1:
                    ct2_int8 = rows[-1]
            if "batch1" not in skip:
                sub = src[:min(len(src), 100)]
                hyps, secs = run_ours(a.model, sub, a.threads, a.passes,
                                      **{**best, "max_sentences": 1, "pipeline": False})
                record(f"latency: ours {tag} greedy, batch 1", hyps, secs, sub)
                hyps, secs = run_ct2(ct2_dir, a.model, sub, a.threads, "int8", 1, batch1=True)
                record("latency: CTranslate2 int8 greedy, batch 1", hyps, secs, sub)
    profile = None
    if a.profile:
        profile = profile_best(a.model, lines, a.threads, a.max_tokens, best)
    naive = rows[0] if rows and rows[0]["config"].startswith("naive") else None
    for r in rows:
        if naive:
            r["x_naive"] = round(r["src_words_per_s"] / naive["src_words_per_s"], 2)
        if ct2_int8:
            base = ct2_int8
            if r["config"].startswith("latency"):
                base = rows[-1] if rows[-1]["config"].startswith("latency: CT") else ct2_int8
            r["x_ct2_int8"] = round(r["src_words_per_s"] / base["src_words_per_s"], 2)
    machine["load_avg_at_end"] = os.getloadavg()[0]
    out = out_prefix(a)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    md = to_markdown(rows, machine, src_path, len(src), a.repeat, a.model)
    with open(out + ".md", "w") as fh:
        fh.write(md)
    with open(out + ".json", "w") as fh:
        json.dump({"machine": machine, "input": src_path, "lines": len(src), "repeat": a.repeat,
                   "model": os.path.abspath(a.model), "rows": rows}, fh, indent=2)
    if profile:
        with open(out + "-profile.txt", "w") as fh:
            fh.write(profile)
    print(md)


class Phases:
    """Seconds per decoding phase, through the Translator's `phase` hook."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


def profile_best(model_dir, lines, threads, max_tokens, best: dict) -> str:
    """Where the time of the best configuration goes: phases, then ops."""
    import torch
    tr = Translator(model_dir, threads=threads, **{**best, "max_tokens": max_tokens, "pipeline": False})
    tr.translate(lines[:8])
    phases = Phases()
    tr.phase = phases.phase
    t = time.perf_counter()
    tr.translate(lines)
    total = time.perf_counter() - t
    tr.phase = Translator.phase
    with torch.profiler.profile() as prof:
        tr.translate(lines)
    out = [f"best configuration ({best['precision']} greedy), {len(lines)} lines, {threads} threads: {total:.3f} s"]
    for k, v in phases.seconds.items():
        out.append(f"  {k:14s} {v:7.3f} s  {100 * v / total:5.1f}%")
    out.append(f"  {'rest':14s} {total - sum(phases.seconds.values()):7.3f} s  (search bookkeeping, text, batching)")
    out.append("")
    out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return "\n".join(out) + "\n"


def to_markdown(rows, machine, src_path, n, repeat, model) -> str:
    cols = [("config", "configuration"), ("src_words_per_s", "src words/s"), ("tgt_tokens_per_s", "tgt tokens/s"),
            ("bleu", "BLEU"), ("chrf", "chrF"), ("x_naive", "x naive"), ("x_ct2_int8", "x CT2 int8")]
    out = [f"Machine: {machine['cpu']}, {machine['cores']} cores, flags: {' '.join(machine['flags'])}; "
           f"torch {machine['torch']} ({machine['torch_cpu_capability']}), {machine['threads']} threads; "
           f"CTranslate2 {machine.get('ctranslate2', '-')} with CT2_FORCE_CPU_ISA={machine['ct2_isa']}; "
           f"load average {machine['load_avg_at_start']:.1f} at start, {machine['load_avg_at_end']:.1f} at end.",
           f"Model: `{model}`. Input: `{src_path}` ({n} lines x {repeat}).", "",
           "| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(k, "")) for k, _ in cols) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
