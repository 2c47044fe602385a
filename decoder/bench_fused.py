"""python -m decoder.bench_fused --model DIR [--src F --ref F] [--threads N] [--passes K]

The fused kernels and the lexical shortlist against the plain fp32 decoder, each
switch alone: all configurations of a group are built first, then timed in
turns, pass after pass, and the fastest pass counts, so drifting load on a
shared machine hits every configuration alike. Prints a markdown table
(docs/bench/fused-and-shortlist-*.md).
"""
from __future__ import annotations

import argparse
import os
import time

# every fused switch off, whatever the decoder's defaults: each row adds its own
PLAIN = dict(fused_norm=False, fused_relu=False, fused_attention=False, fused_cache=False, fused_argmax=False,
             fused_project_argmax=False, fused_topk=False, fused_log_softmax=False)
FOUR = dict(fused_norm=True, fused_relu=True, fused_attention=True, fused_cache=True)
GREEDY = {"plain (best fp32 greedy)": {}, "+ fused bias+residual+LayerNorm": dict(fused_norm=True),
          "+ fused bias+relu": dict(fused_relu=True), "+ fused decode-step attention": dict(fused_attention=True),
          "+ fused q/k/v split into the cache": dict(fused_cache=True), "+ all four": FOUR,
          "+ fused argmax": dict(fused_argmax=True), "+ fused projection+argmax": dict(fused_project_argmax=True),
          "+ all four + projection+argmax": dict(FOUR, fused_project_argmax=True),
          "+ norm, relu and projection+argmax": dict(fused_norm=True, fused_relu=True, fused_project_argmax=True),
          "+ lexical shortlist (no fused kernels)": dict(shortlist=True)}
BEAM = {"beam 4 (plain)": dict(beam=4), "beam 4 + fused add+top-k": dict(beam=4, fused_topk=True),
        "beam 4 + fused log-softmax+top-k": dict(beam=4, fused_topk=True, fused_log_softmax=True),
        "beam 4 + lexical shortlist": dict(beam=4, shortlist=True)}


def main(argv=None):
    from .bench import DEFAULT_DATA, cpu_info, read, scores
    p = argparse.ArgumentParser(prog="python -m decoder.bench_fused", description=__doc__.split("\n\n")[1])
    p.add_argument("--model", required=True)
    p.add_argument("--src", default=os.path.join(DEFAULT_DATA, "test.en"))
    p.add_argument("--ref", default=None, help="default: --src with .es for .en")
    p.add_argument("--lines", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=3)
    a = p.parse_args(argv)
    import torch

    from .translator import Translator
    torch.set_num_threads(a.threads)
    src = read(a.src)
    ref = read(a.ref or a.src[:-3] + ".es")
    if a.lines:
        src, ref = src[:a.lines], ref[:a.lines]
    words = sum(len(s.split()) for s in src)
    shortlist = os.path.exists(os.path.join(a.model, "shortlist.safetensors"))
    rows = []
    for group in (GREEDY, BEAM):
        trs = {k: Translator(a.model, precision="fp32", **{**PLAIN, **kw}) for k, kw in group.items()
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
        rows += [(k, words / best[k], best[base] / best[k], scores(outs[k], ref)[0], outs[k] == outs[base])
                 for k in trs]
    m = cpu_info()
    print(f"Machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}; torch {torch.__version__}, "
          f"{a.threads} threads. {len(src)} lines ({words} words), fastest of {a.passes} interleaved passes.\n")
    print("| configuration | words/s | x plain | BLEU | same output as plain |\n|---|---:|---:|---:|---|")
    for k, w, x, b, same in rows:
        print(f"| {k} | {w:,.0f} | {x:.3f} | {b:.2f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
