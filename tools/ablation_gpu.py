"""python -m tools.ablation_gpu --model DIR [--src F --ref F] [--lines N] [--passes K] [--out PREFIX]

The GPU rows of the ablation (the engines head to head: tools/bench_gpu.py):
fp32 and fp16 eager, fp16 with CUDA graphs, each fused CUDA kernel alone and
all of them (eager, and captured in the graphs where the fixed-shape step uses
them), greedy and beam 4. All configurations
are built first and timed in turns, pass after pass; the fastest pass counts.
Then one batch of fp16 eager greedy runs under torch.profiler: its GEMM kernels
by GPU time, each marked by whether its name is a tensor-core kernel, so
"fp16 runs on tensor cores" is read off the profile, not assumed.

Without CUDA it says so and runs the same rows on CPU (fp32 for fp16, no
graphs): the path the tests take. With --out, writes PREFIX.md and PREFIX.json.
"""
from __future__ import annotations

import json
import os
import re
import sys

import torch

from decoder import cliargs
from decoder.machine import cpu_info
from decoder.optimisations import group, kernels_off
from decoder.translator import Translator

from .baselines import alternating
from .bench import add_test_set_args, read_test_set, scores

PLAIN = kernels_off()

# By name, so the table lists the names for the reader to check: half-precision
# cuBLAS/CUTLASS kernels (f16/bf16 in the name, Volta..Ampere mma shapes, Hopper
# wgmma, cuBLASLt's nvjet_h*/nvjet_b*, CUTLASS "tensorop") run on tensor cores;
# sgemm/gemv kernels do not.
TENSOR_CORE = re.compile(r"f16|s16816|h16816|1688|884|hmma|wgmma|tensorop|nvjet_[hb]|tf32", re.I)
GEMM = re.compile(r"gemm|gemv|xmma|nvjet|cutlass|matmul|mma|addmm|aten::mm$|aten::linear$", re.I)



def configurations(cuda: bool) -> list[tuple[str, dict]]:
    """Generated from decoder/optimisations.py: every row starts from all fused
    switches off (PLAIN), whatever the decoder's defaults, and adds its own."""
    half = "fp16" if cuda else "fp32"
    eager = dict(PLAIN, precision=half, cuda_graphs=False)
    graphs = dict(PLAIN, precision=half, cuda_graphs=True)
    every = {o.name: True for o in group("step") + group("greedy")}
    in_graph = {o.name: True for o in group("step") if o.name == "fused_norm"}  # the static step
    rows = [("fp32, eager (first row)", dict(PLAIN, precision="fp32", cuda_graphs=False)),
            (f"{half}, eager", eager), (f"{half} + CUDA graphs", graphs),
            (f"{half} + CUDA graphs, attention through the decode-step kernel",
             {**graphs, "fused_attention": True, "graph_attention": True})]
    rows += [(f"{half}, eager + {o.label}", {**eager, o.name: True}) for o in group("step") + group("greedy")]
    rows += [(f"{half}, eager + all fused kernels", {**eager, **every}),
             (f"{half} + CUDA graphs + {', '.join(in_graph)}", {**graphs, **in_graph}),
             (f"{half} + CUDA graphs, beam 4", {**graphs, "beam": 4}), (f"{half}, eager, beam 4", {**eager, "beam": 4})]
    cur = {**eager, "beam": 4}
    for o in group("beam"):
        cur = {**cur, o.name: True}
        rows.append((f"{half}, eager, beam 4 + {o.label}", dict(cur)))
    return rows


def gemm_profile(tr, lines: list[str]) -> list[dict]:
    """GEMM kernels of translating `lines` once, by GPU time (CPU: the matmul ops)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = tr.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        tr.translate(lines)
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) if cuda else e.self_cpu_time_total
        if t and GEMM.search(e.key) and (cuda or e.key.startswith("aten::")):
            rows.append(dict(kernel=e.key, calls=e.count, us=round(float(t), 1),
                             tensor_core=bool(TENSOR_CORE.search(e.key)) if cuda else None))
    return sorted(rows, key=lambda r: -r["us"])


def main(argv=None) -> int:
    p = cliargs.ArgumentParser(prog="python -m tools.ablation_gpu", description=__doc__.split("\n\n")[1],
                               formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    add_test_set_args(p)
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.json")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        print("warning: CUDA is not available; the same rows run on CPU (fp32, no graphs)", file=sys.stderr)
    src, ref = read_test_set(a)
    words = sum(len(s.split()) for s in src)
    dev = "cuda" if cuda else "cpu"
    trs = {name: Translator(a.model, device=dev, **kw) for name, kw in configurations(cuda)}
    # warm-up on 64 lines: kernels built, graphs captured once per shape, cuBLAS handles; translate returns
    # Python strings, so a pass ends when the GPU is done
    timed = alternating([tr.translate for tr in trs.values()], src, a.passes, warm=64)  # [(outputs, s)]
    base_s = timed[0][1]
    rows = [dict(configuration=k, words_per_s=round(words / s, 1), ratio=round(base_s / s, 3),
                 bleu=scores(out, ref)[0]) for k, (out, s) in zip(trs, timed)]
    prof_cfg = "fp16, eager" if cuda else "fp32, eager"
    gemms = gemm_profile(trs[prof_cfg], src[:64])
    total = sum(g["us"] for g in gemms) or 1.0
    tc = sum(g["us"] for g in gemms if g["tensor_core"])
    m = cpu_info()
    gpu = torch.cuda.get_device_name() if cuda else "none"
    head = (f"GPU: {gpu}; CPU: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}; torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}). {len(src)} lines ({words} words), fastest of "
            f"{a.passes} interleaved passes; ratios against the first row.")
    md = [head, "", "| configuration | words/s | x first row | BLEU |", "|---|---:|---:|---:|"]
    md += [f"| {r['configuration']} | {r['words_per_s']:,.0f} | {r['ratio']:.3f} | {r['bleu']:.2f} |" for r in rows]
    md += ["", f"GEMM kernels of one batch of 64 lines, {prof_cfg} greedy"
           + (f" (tensor-core kernels: {100 * tc / total:.0f}% of GEMM time):" if cuda else " (CPU ops):"),
           "", "| kernel | calls | time (us) | tensor cores |", "|---|---:|---:|---|"]
    md += [f"| `{g['kernel'][:110]}` | {g['calls']} | {g['us']:,.0f} | "
           f"{'-' if g['tensor_core'] is None else 'yes' if g['tensor_core'] else 'no'} |" for g in gemms[:12]]
    print("\n".join(md))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".md", "w") as fh:
            fh.write("\n".join(md) + "\n")
        with open(a.out + ".json", "w") as fh:
            json.dump(dict(machine=dict(gpu=gpu, **m, torch=torch.__version__), lines=len(src), words=words,
                           passes=a.passes, rows=rows, gemm_kernels=gemms), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
