"""int8 linear kernels against fp32 at the students' decode shapes, one thread.

    python -m tools.bench_int8 [--repeat 7] [--capped]

Rows: the layer linears of one decoder step (d -> 3d q|k|v, d -> d, d -> f,
f -> d) and the output projection d -> 8000, at 1 row (batch-1 latency), 4
rows (a few live sentences), 64 rows (a throughput batch) and 160 (beam 4), for d256
(student-tiny) and d512 (student-6-1). Columns: fp32 `F.linear`, our `_int_mm`
C++ op (decoder/quant.py `Int8Linear`), fbgemm's prepacked dynamic linear
(`FbgemmLinear`), our few-row kernel (`int8_gemv`: `FbgemmLinear` with
`gemv_rows=4`, so up to 4 rows), and what a shortlist's slice costs once per batch. Each cell is the fastest of
`--repeat` interleaved passes (the machine is shared: min, not mean).
`--capped` reruns the table in a child process with every ISA knob at AVX2:
ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, fbgemm's own
FBGEMM_ENABLE_INSTRUCTIONS (fbgemm dispatches on its own cpuinfo, not ATen's) and
our kernels' DECODER_MAX_CPU_ISA.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from decoder import ops
from decoder.cliargs import ArgumentParser, add_version, positive_int
from decoder.quant import FbgemmLinear, Int8Linear, fbgemm_available, fbgemm_vnni, gemv_isa_cap

CAP = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
       ops.ISA_CAP: "avx2"}


def shapes(d: int, f: int, vocab: int = 8000) -> list[tuple[str, int, int]]:
    return [("q|k|v", d, 3 * d), ("out", d, d), ("fc1", d, f), ("fc2", f, d), ("output proj", d, vocab)]


def per_call(fn, budget_s: float = 0.02) -> float:
    """Mean seconds per call over a ~budget_s loop."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt > budget_s:
            return dt / n


def cases() -> list[tuple[str, dict]]:
    out = []
    for d, f in ((256, 1024), (512, 2048)):
        for name, k, n in shapes(d, f):
            w, b = torch.randn(n, k) * 0.05, torch.randn(n) * 0.1
            i8, fb, gv = Int8Linear(w, b), FbgemmLinear(w, b), FbgemmLinear(w, b, gemv_rows=4)
            for rows in (1, 4, 64, 160):
                x = torch.randn(rows, k)
                fns = {"fp32": lambda x=x, w=w, b=b: F.linear(x, w, b),
                       "_int_mm": lambda x=x, i8=i8: i8(x), "fbgemm": lambda x=x, fb=fb: fb(x)}
                if rows <= 4 and gv.gemv is not None:
                    fns["gemv"] = lambda x=x, gv=gv: gv(x)
                out.append((f"d{d} {name} ({rows}, {k}, {n})", fns))
    w = torch.randn(8000, 256)
    fb, idx = FbgemmLinear(w, None), torch.randperm(8000)[:2000].sort().values
    out.append(("shortlist: slice 2000 of 8000 rows (d256)", {"fbgemm": lambda: fb.rows(idx)}))
    return out


def table(repeat: int) -> str:
    torch.set_num_threads(1)
    assert fbgemm_available()
    cs = cases()
    best: list[dict] = [{} for _ in cs]
    for _ in range(repeat):  # interleaved: each pass times every cell once
        for (_, fns), b in zip(cs, best):
            for k, fn in fns.items():
                b[k] = min(b.get(k, float("inf")), per_call(fn))
    cols = ("fp32", "_int_mm", "fbgemm", "gemv")
    env = " ".join(f"{k}={os.environ[k]}" for k in CAP if k in os.environ) or "native"
    path = ("plain C++", "AVX2", "AVX-512 VNNI")[ops.int8_gemv_isa(gemv_isa_cap())] if ops.available() else "-"
    lines = [f"{env}: ATen {torch.backends.cpu.get_cpu_capability()}, fbgemm VNNI {fbgemm_vnni()}, "
             f"our kernels {ops.kernel_isa() if ops.available() else '-'}, gemv {path}, torch {torch.__version__}, "
             f"1 thread, us per call (min of {repeat})", "",
             "| shape (rows, in, out) | " + " | ".join(cols) + " | fbgemm vs fp32 | gemv vs fbgemm |",
             "|---" * 7 + "|"]
    for (name, _), b in zip(cs, best):
        cell = [f"{b[c] * 1e6:.1f}" if c in b else "-" for c in cols]
        ratio = f"{b['fp32'] / b['fbgemm']:.2f}x" if "fp32" in b else ""
        gain = f"{b['fbgemm'] / b['gemv']:.2f}x" if "gemv" in b else ""
        lines.append(f"| {name} | " + " | ".join(cell) + f" | {ratio} | {gain} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m tools.bench_int8", description=__doc__.split("\n\n")[0])
    add_version(p)
    p.add_argument("--repeat", type=positive_int, default=7, help="interleaved passes; each cell is their min")
    p.add_argument("--capped", action="store_true", help="also the table with every ISA knob at AVX2")
    a = p.parse_args(argv)
    print(table(a.repeat), flush=True)
    if a.capped:
        print(flush=True)
        subprocess.run([sys.executable, "-m", "tools.bench_int8", "--repeat", str(a.repeat)],
                       env={**os.environ, **CAP}, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
