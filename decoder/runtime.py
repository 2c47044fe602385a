"""Process-level settings that decoding speed depends on."""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_done = False


def retain_freed_memory(limit: int = 1 << 30) -> bool:
    """Make glibc keep freed blocks for reuse instead of returning them to the OS.

    Every batch allocates the same large activations; by default glibc serves
    each from a fresh mmap and unmaps it on free, so every step pays page
    faults on first touch (a 4000x1024 fp32 result: 43 ms with, 10 ms without,
    measured in docs/bench/decoder.md). CTranslate2 gets the same effect from its
    caching allocator. Process-wide, idempotent; no-op off glibc.
    """
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, limit) and libc.mallopt(_M_TRIM_THRESHOLD, 2 * limit)
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return False
    _done = bool(ok)
    return _done


def describe(tr, requested: str | None = None) -> str:
    """The one stderr line a command prints once its Translator is loaded: what runs,
    so that two outputs can be told apart (fp32 and int8 differ on a few lines)."""
    import torch
    precision = tr.precision + (f" ({requested})" if requested not in (None, "auto", tr.precision) else "")
    if requested in (None, "auto"):  # the fast default, and why it is this one
        precision += (" (the default on CUDA)" if tr.device.startswith("cuda") else
                      " (the default: this CPU has an int8 kernel)" if tr.precision == "int8" else
                      " (the default: no int8 kernel on this CPU)")
    if tr.pool is not None:
        par = f"{tr.opts.workers} worker processes x 1 thread"
    else:
        par = f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}"
    where = (f"cuda {torch.cuda.get_device_name(tr.device)}" if tr.device.startswith("cuda")
             else f"cpu ISA {torch.backends.cpu.get_cpu_capability()}")
    if tr.precision == "int8":
        from .quant import describe_int8
        where += f", int8 by {describe_int8(tr.plan.int8_kernel)}"
    from .fused import describe as fused_ops  # whether the C++/CUDA kernels built (and passed their check)
    # the plan as resolved for this device (decoder/optimisations.py Plan.summary), and the batch sizes
    plan = f"; {tr.plan.summary(tr.precision)}; batches {tr.opts.max_tokens} tokens x {tr.opts.max_sentences}"
    return f"decoder: precision {precision}, {par}, {where}; {fused_ops()}" + plan
