"""python -m tools.bench_fused --model DIR [--src F --ref F] [--threads N] [--passes K] [--precision P]

The fused kernels and the lexical shortlist against the plain decoder (fp32, or --precision), each
switch alone: all configurations of a group are built first, then timed in
turns, pass after pass, and the fastest pass counts, so drifting load on a
shared machine hits every configuration alike. Prints a markdown table
(docs/bench/fused-and-shortlist-*.md).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from decoder import cliargs
from decoder.machine import cpu_info
from decoder.optimisations import group, kernels_off
from decoder.translator import Translator

from .bench import add_test_set_args, read_test_set, scores

PLAIN = kernels_off()  # every fused switch off, whatever the decoder's defaults: each row adds its own


def rows() -> tuple[dict, dict]:
    """(greedy rows, beam rows): name -> switches, generated from decoder/optimisations.py."""
    step, greedy = group("step"), group("greedy")
    all_step = {o.name: True for o in step}
    g = {"plain (best fp32 greedy)": {}}
    g.update({f"+ {o.label}": {**o.row, o.name: True} for o in step + greedy})
    g[f"+ all of {', '.join(o.name for o in step)}"] = all_step
    g.update({f"+ all of those + {o.label}": {**all_step, **o.row, o.name: True} for o in greedy})
    g.update({f"+ {o.label} (no fused kernels)": {o.name: True} for o in group("shortlist")})
    b, cur = {"beam 4 (plain)": dict(beam=4)}, dict(beam=4)
    for o in group("beam"):
        cur = {**cur, o.name: True}
        b[f"beam 4 + {o.label}"] = dict(cur)
    b.update({f"beam 4 + {o.label}": dict(beam=4, **{o.name: True}) for o in group("shortlist")})
    return g, b


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.bench_fused", description=__doc__.split("\n\n")[1],
                                formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    add_test_set_args(p)
    p.add_argument("--threads", type=cliargs.positive_int, default=2)
    p.add_argument("--precision", choices=("fp32", "int8", "bf16"), default="fp32",
                   help="of every row: int8 measures the kernels of the int8 output layer (fused_project_topk)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    src, ref = read_test_set(a)
    words = sum(len(s.split()) for s in src)
    shortlist = os.path.exists(os.path.join(a.model, "shortlist.safetensors"))
    table = []
    for configs in rows():
        trs = {k: Translator(a.model, precision=a.precision, **{**PLAIN, **kw}) for k, kw in configs.items()
               if shortlist or not kw.get("shortlist")}
        for tr in trs.values():
            tr.translate(src[:8])  # warm-up
        best, outs = {k: float("inf") for k in trs}, {}
        for _ in range(a.passes):
            for k, tr in trs.items():
                t = time.perf_counter()
                outs[k] = tr.translate(src)
                best[k] = min(best[k], time.perf_counter() - t)
        base = next(iter(trs))
        table += [(k, words / best[k], best[base] / best[k], scores(outs[k], ref)[0], outs[k] == outs[base])
                 for k in trs]
    m = cpu_info()
    print(f"Machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}; torch {torch.__version__}, "
          f"{a.threads} threads, {a.precision}. {len(src)} lines ({words} words), fastest of {a.passes} interleaved "
          f"passes.\n")
    print("| configuration | words/s | x plain | BLEU | same output as plain |\n|---|---:|---:|---:|---|")
    for k, w, x, b, same in table:
        print(f"| {k} | {w:,.0f} | {x:.3f} | {b:.2f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
