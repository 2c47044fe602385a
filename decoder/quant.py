"""Linear layers per precision, built once at load time.

int8 is our own dynamic quantisation on `torch._int_mm`: weights int8 with one
scale per output row (symmetric), activations int8 with one scale per input
row computed on the fly, int32 accumulation, one fused rescale + bias. Why this
path and not the others is measured in decoder/README.md ("int8"): fbgemm's
`quantized::linear_dynamic` was as fast but needs the deprecated quantized
tensor types; `_weight_int8pack_mm` (weight-only) and oneDNN `qlinear_pointwise`
(per-tensor activation scale) were 2-5x slower at our shapes. `_int_mm`
dispatches to oneDNN, which picks VNNI/AVX-512/AVX2 kernels at run time.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import ops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}


class Linear:
    """y = x @ w.T + b in the compute dtype of the precision."""
    dense = True  # a plain weight matrix that fused ops downstream can take as it is

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype):
        self.w = w.to(dtype).contiguous()  # (out, in)
        self.b = None if b is None else b.to(dtype).contiguous()

    @property
    def out_features(self) -> int:
        return self.w.shape[0]

    def __call__(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        y = F.linear(x, self.w, self.b)
        return F.relu(y) if relu else y

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T without the bias: a fused op downstream adds it."""
        return F.linear(x, self.w)

    def rows(self, idx: torch.Tensor) -> "Linear":
        """This layer restricted to the output features idx (C,): a shortlist's projection."""
        new = Linear.__new__(Linear)
        new.w = self.w.index_select(0, idx)  # (C, in)
        new.b = None if self.b is None else self.b.index_select(0, idx)
        return new


class Int8Linear:
    """Dynamic int8: per-row activation scales, per-output-channel weight scales."""
    dense = False  # bias and relu go into the int8 op's own epilogue

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, fused: bool = True):
        # fused: one C++ call (decoder/csrc/int8_linear.cpp) instead of ~8 tensor ops
        self.fused = fused and ops.available()
        w = w.float()
        self.w_scale = (w.abs().amax(1).clamp_min(1e-12) / 127.0)  # (out,)
        # (in, out) contiguous: _int_mm's fast layout (a transposed view is ~40% slower)
        self.wq_t = torch.round(w / self.w_scale[:, None]).clamp_(-127, 127).to(torch.int8).t().contiguous()
        self.b = None if b is None else b.float().contiguous()

    @property
    def out_features(self) -> int:
        return self.wq_t.shape[1]

    def rows(self, idx: torch.Tensor) -> "Int8Linear":
        """This layer restricted to the output features idx (C,): weights, scales and
        bias sliced together, so the result equals those columns of the full output."""
        new = Int8Linear.__new__(Int8Linear)
        new.fused = self.fused
        new.w_scale = self.w_scale.index_select(0, idx)  # (C,)
        new.wq_t = self.wq_t.index_select(1, idx).contiguous()  # (in, C), _int_mm's layout
        new.b = None if self.b is None else self.b.index_select(0, idx)
        return new

    def __call__(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        if self.fused:
            return ops.int8_linear(x, self.wq_t, self.w_scale, self.b, relu)
        y = self.reference(x)
        return y.relu_() if relu else y

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """Without the bias: a fused op downstream adds it."""
        if self.fused:
            return ops.int8_linear(x, self.wq_t, self.w_scale, None, False)
        return self.reference(x, bias=False)

    def reference(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The PyTorch definition the fused op is tested against."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # (M, in)
        # few, in-place passes: at decode shapes the elementwise work rivals the matmul
        amax = x2.abs().amax(1, keepdim=True).clamp_min_(1e-12)  # (M, 1)
        xq = torch.mul(x2, 127.0 / amax).round_().to(torch.int8)
        y = torch._int_mm(xq, self.wq_t).float()  # (M, out)
        y.mul_(amax.mul_(1.0 / 127.0))
        if self.b is None or not bias:
            y.mul_(self.w_scale)
        else:
            torch.addcmul(self.b, y, self.w_scale, out=y)
        return y.view(*shape[:-1], -1)


def make_linear(w: torch.Tensor, b: torch.Tensor | None, precision: str, fused_ops: bool = True):
    if precision == "int8":
        return Int8Linear(w, b, fused=fused_ops)
    return Linear(w, b, DTYPES[precision])


def int8_available() -> bool:
    try:
        torch._int_mm(torch.ones(17, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
        return True
    except RuntimeError:
        return False


_int8_pays: dict = {}


def int8_pays() -> bool:
    """Whether int8 beats fp32 here, measured once per process on a decode-sized product.

    `_int_mm` is fast only where oneDNN takes it (VNNI / AVX-512: 2.6x faster
    than fp32 at (64, 256, 768), decoder/README.md); on an AVX2-only EPYC it
    ran a plain loop, 13x slower than fp32. CPU flags do not say which path a
    given torch build takes, so measure: the gap is an order of magnitude either
    way, far beyond timing noise, so the choice is stable from run to run."""
    if "v" not in _int8_pays:
        # one thread: on a busy machine a 2-thread fp32 product waits on its
        # slowest thread (16 ms instead of 0.5 ms measured), which hides the gap
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _int8_pays["v"] = int8_available() and _time_int8() < _time_fp32()
        finally:
            torch.set_num_threads(n)
    return _int8_pays["v"]


def _best_of(f, n: int = 3) -> float:
    f()  # first call: oneDNN primitive creation, page faults
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def _time_int8() -> float:
    xq = torch.ones(64, 256, dtype=torch.int8)
    wq = torch.ones(256, 768, dtype=torch.int8)
    return _best_of(lambda: torch._int_mm(xq, wq))


def _time_fp32() -> float:
    x, w = torch.ones(64, 256), torch.ones(768, 256)
    return _best_of(lambda: F.linear(x, w))
