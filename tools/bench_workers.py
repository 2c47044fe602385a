"""How two cores share one model: the same batches, the same output, six ways.

    python -m tools.bench_workers --model DIR [--src FILE] [--passes 3] [--out PREFIX]

CPU-ALL today runs one pinned 1-thread worker process per core, each with its own
copy of the model (decoder/workers.py). Two such workers each run slower than one
alone; this measures whether that is memory (two copies of the weights in one L3)
or something a different arrangement avoids:

- `1 process, 1 thread`: the per-core rate, the yardstick of the slowdown;
- `1 process, 2 intra-op threads`: torch splits every op over both cores;
- `1 process, 2 threads sharing the model`: two Python threads, one model, torch at
  one thread each (CTranslate2's inter_threads; ours holds the GIL between ops);
- `2 spawned workers`: today's `workers=2`;
- `2 forked processes, one model`: the parent's prepared model shared copy-on-write,
  so both cores read one copy of the weights;
- `2 forked processes, a model each`: the same processes, each loading its own.

The last two differ only in whether the weights are shared. Every arrangement
decodes the same pre-tokenised batches (the decoder's own batching), hands them out
as the cores free up, and must give the tokens of `1 process, 1 thread`.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from decoder import cliargs
from decoder.batching import make_batches
from decoder.machine import describe, one_line
from decoder.translator import Translator

from .bench import read


def batches_of(tr: Translator, lines: list[str]) -> list[list[list[int]]]:
    """The decoder's own batches of `lines`, as source ids."""
    srcs = [s for s in tr.text.encode(lines) if s is not None]
    o = tr.opts
    return [[srcs[j] for j in b] for b in make_batches([len(s) for s in srcs], o.max_tokens, o.max_sentences,
                                                     tr.plan.sort)]


def _child(make, jobs, results, core: int, warm) -> None:
    """A forked process: pinned to `core`, it translates `warm` (as a spawned worker has
    warmed up on earlier batches), says it is ready, then translates (number, batch)
    items from `jobs` until None."""
    os.sched_setaffinity(0, {core})
    tr = make()
    tr.translate_ids(warm)
    results.put(None)
    while (item := jobs.get()) is not None:
        results.put((item[0], tr.translate_ids(item[1])))


def forked(make, batches, cores: list[int]):
    """One forked process per core takes `batches` as it frees up; -> (outputs in batch
    order, seconds from every process ready (its model loaded, one batch decoded) to
    the last output)."""
    ctx = mp.get_context("fork")  # a 1-thread torch never started an OpenMP pool to inherit
    jobs, results = ctx.Queue(), ctx.Queue()
    warm = max(batches, key=lambda b: len(b) * max(map(len, b)))  # the most padded tokens
    procs = [ctx.Process(target=_child, args=(make, jobs, results, c, warm)) for c in cores]
    for p in procs:
        p.start()
    for _ in procs:
        results.get()  # each has its translator: a model load is not decoding time
    t = time.perf_counter()
    for item in enumerate(batches):
        jobs.put(item)
    out = [None] * len(batches)
    for _ in batches:
        i, ids = results.get()
        out[i] = ids
    dt = time.perf_counter() - t
    for _ in procs:
        jobs.put(None)
    for p in procs:
        p.join()
    return out, dt


def timed(fn):
    def run():
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t
    return run


def arrangements(model: str, kw: dict, batches):
    """(name -> a callable that decodes `batches`: (outputs, seconds), the worker pool to close)."""
    torch.set_num_threads(1)
    one = Translator(model, threads=1, **kw)
    pool = ThreadPoolExecutor(2)
    workers = Translator(model, workers=2, **kw)
    workers.pool.wait_started()
    cores = sorted(os.sched_getaffinity(0))[:2]

    def intra():
        torch.set_num_threads(2)
        try:
            return [one.translate_ids(b) for b in batches]
        finally:
            torch.set_num_threads(1)
    return {
        "1 process, 1 thread": timed(lambda: [one.translate_ids(b) for b in batches]),
        "1 process, 2 intra-op threads": timed(intra),
        "1 process, 2 threads sharing the model": timed(lambda: list(pool.map(one.translate_ids, batches))),
        "2 spawned workers": timed(lambda: [j.result() for j in [workers.pool.submit(b) for b in batches]]),
        "2 forked processes, one model": lambda: forked(lambda: one, batches, cores),
        "2 forked processes, a model each": lambda: forked(lambda: Translator(model, threads=1, **kw), batches, cores),
    }, workers


def measure(model: str, lines: list[str], kw: dict, passes: int) -> dict:
    """{arrangement: best source words/s over `passes`}, each pass running every arrangement in turn."""
    tr = Translator(model, threads=1, **kw)
    batches = batches_of(tr, lines)
    words = sum(len(s.split()) for s in lines)
    runs, workers = arrangements(model, kw, batches)
    want, _ = runs["1 process, 1 thread"]()
    best = {name: 0.0 for name in runs}
    try:
        for _ in range(passes):
            for name, run in runs.items():
                out, dt = run()
                if out != want:
                    raise SystemExit(f"error: {name} gave other tokens than one process with one thread")
                best[name] = max(best[name], words / dt)
    finally:
        workers.close()
    return best


def main(argv=None) -> None:
    p = cliargs.ArgumentParser(prog="python -m tools.bench_workers", description=__doc__.split("\n\n")[0],
                               formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    p.add_argument("--model", required=True, help="model dir")
    p.add_argument("--src", required=True, help="source lines")
    p.add_argument("--lines", type=cliargs.nonneg_int, default=0, help="first N lines only (0: all)")
    p.add_argument("--precision", choices=("fp32", "int8", "bf16", "auto"), default="int8",
                   help="the decoder's precision")
    p.add_argument("--shortlist", action="store_true", help="decode with the model dir's lexical shortlist")
    p.add_argument("--passes", type=cliargs.positive_int, default=3,
                   help="timed passes of every arrangement, in turns; the fastest counts")
    p.add_argument("--out", default=None, help="also write PREFIX.json and PREFIX.md")
    a = p.parse_args(argv)
    cliargs.refuse_missing(a.model, src=a.src)
    lines = read(a.src)[:a.lines or None]
    machine = describe()
    print(f"machine: {one_line(machine)}", flush=True)
    kw = dict(precision=a.precision, shortlist=a.shortlist)
    rates = measure(a.model, lines, kw, a.passes)
    base = rates["1 process, 1 thread"]
    table = ["| arrangement | source words/s | x 1 thread | per core, x 1 thread alone |", "|---|---:|---:|---:|"]
    for name, r in rates.items():
        n = 1 if name == "1 process, 1 thread" else 2
        table.append(f"| {name} | {r:,.0f} | {r / base:.2f} | {r / base / n:.2f} |")
    print("\n".join(table))
    if a.out:
        result = {"machine": machine, "model": a.model, "lines": len(lines), "settings": kw,
                  "words_per_s": {k: round(v, 1) for k, v in rates.items()}}
        with open(a.out + ".json", "w") as fh:
            json.dump(result, fh, indent=1)
        with open(a.out + ".md", "w") as fh:
            fh.write(f"Machine: {one_line(machine)}.\n"
                     f"Model: `{a.model}`, {len(lines)} lines, {kw}.\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
