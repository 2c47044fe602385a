"""python -m tools.bench_kernels [--rows N] [--repeats K] [--out FILE.json]

The CUDA kernels with 16-byte loads against the ones they replaced, side by side in one run, at
the decoder's shapes on a GPU (student-6-1: 512 wide, fp16, logits in vocabulary chunks of 1,024;
N rows a step, as large batches give). fused_cuda.cu picks the wide kernel (residual+norm,
argmax) where every row is 16-byte aligned and the older one where it is not, so each op runs
on its inputs as allocated and on a copy of them one element off a 16-byte boundary: the same
values, the other kernel. Each row of the table: the median of K timed calls (CUDA events) each
way, the ratio, and the largest difference of their outputs. Needs a GPU and the CUDA kernels
(decoder/csrc/fused_cuda.cu).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

from decoder import cliargs, ops

WIDTH, CHUNK = 512, 1024


def off_boundary(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` whose data starts one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return flat[1:].view(t.shape).copy_(t)


def cases(rows: int, device: str, dtype=torch.float16, seed: int = 0) -> dict[str, tuple[Callable, list]]:
    """name -> (op, its inputs as allocated), the decoder's shapes for `rows` rows."""
    g = torch.Generator(device).manual_seed(seed)  # drawn where they are used: GBs at 8,192 rows

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)
    o = torch.ops.decoder_ops
    return {
        # x, h (rows, W); bias, gamma, beta (W,)
        f"residual + layer norm ({WIDTH})": (o.add_bias_residual_layernorm,
                                              [rnd(rows, WIDTH), rnd(rows, WIDTH), rnd(WIDTH), rnd(WIDTH), rnd(WIDTH),
                                               1e-5]),
        f"argmax of a vocabulary chunk ({CHUNK})": (o.argmax_rows, [rnd(rows, CHUNK)]),  # (rows, chunk)
    }


def shifted(args: list) -> list:
    """The floating-point tensors among an op's inputs moved off the 16-byte boundary."""
    return [off_boundary(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def timed(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median ms of `repeats` calls after three warm-ups; CUDA events on a GPU, the host clock elsewhere."""
    for _ in range(3):
        fn()
    ms = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms)


def first(out) -> torch.Tensor:
    return out[-1] if isinstance(out, (tuple, list)) else out  # residual+norm: its normed output


def measure(rows: int, repeats: int, device: str) -> list[dict]:
    """One row per op: ms on aligned inputs (wide kernel), ms one element off (older kernel)."""
    result = []
    for name, (op, args) in cases(rows, device).items():
        off = shifted(args)
        wide, old = timed(lambda: op(*args), repeats, device), timed(lambda: op(*off), repeats, device)
        a, b = first(op(*args)).float(), first(op(*off)).float()
        diff = float((a - b).abs().nan_to_num().max()) if a.numel() else 0.0
        result.append({"op": name, "rows": rows, "wide_ms": round(wide, 4), "old_ms": round(old, 4),
                       "speedup": round(old / wide, 2) if wide > 0 else None, "max_diff": diff})
    return result


def to_markdown(result: list[dict], head: str) -> str:
    md = [head, "", "| op | rows | 16-byte loads, ms | older kernel, ms | speed-up | largest difference |",
          "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['op']} | {r['rows']:,} | {r['wide_ms']:.3f} | {r['old_ms']:.3f} | {r['speedup']}x | "
           f"{r['max_diff']:.3g} |" for r in result]
    return "\n".join(md) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = cliargs.ArgumentParser(prog="python -m tools.bench_kernels", description=__doc__.split("\n\n")[1],
                               formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    p.add_argument("--rows", type=cliargs.positive_int, default=8192, help="rows a decode step")
    p.add_argument("--repeats", type=cliargs.positive_int, default=50, help="timed calls each way")
    p.add_argument("--out", help="also write the rows as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if not (torch.cuda.is_available() and ops.cuda_available()):
        print("error: tools.bench_kernels needs a GPU and the CUDA kernels (decoder/csrc/fused_cuda.cu)",
              file=sys.stderr)
        return 2
    result = measure(a.rows, a.repeats, "cuda")
    print(to_markdown(result, f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, fp16"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
