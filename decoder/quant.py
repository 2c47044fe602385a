"""Linear layers per precision, built once at load time.

int8 is dynamic quantisation: weights int8 with one symmetric scale per output
row (at load time), activations quantised per call, int32 accumulation. Two
kernels for calls of more than a few rows: fbgemm's prepacked
`quantized::linear_dynamic` (`FbgemmLinear`: u8 x s8 kernels for AVX2 and
AVX-512/VNNI, so int8 pays on every x86 CPU) and our own `_int_mm` path
(`Int8Linear`: one scale per activation row, oneDNN's int8 product: with VNNI
up to 1.35x fbgemm's speed at the layer linears and 1.25x at the output
projection's >= 64 rows, without VNNI 13-30x slower than fp32).
decoder/optimisations.py picks per machine: `fbgemm_int8` (on) takes fbgemm,
`int8_vnni_int_mm` (on) takes `_int_mm` back where it runs VNNI (`int_mm_vnni`).
Either way calls of at most 4 rows run our gemv kernel
(`GemvLinear`, switch `int8_gemv`): at batch 1 the big kernels' fixed costs
dominate. The measurements behind the choices are in docs/bench/decoder.md
("int8 on every x86 CPU", "VNNI", "Batch 1").
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import machine, ops

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

    def rows(self, idx: torch.Tensor, batch_rows: int = 64) -> "Linear":
        """This layer restricted to the output features idx (C,): a shortlist's projection."""
        new = Linear.__new__(Linear)
        new.w = self.w.index_select(0, idx)  # (C, in)
        new.b = None if self.b is None else self.b.index_select(0, idx)
        return new


class QuantRows(NamedTuple):
    """Activations already quantised as an int8 linear would: q (..., K) int8, s (...) the
    rows' scales. An `Int8Linear` hands them to the next one (`Int8Linear.quantized`)."""
    q: torch.Tensor
    s: torch.Tensor


class Int8Linear:
    """Dynamic int8: per-row activation scales, per-output-channel weight scales."""
    dense = False  # bias and relu go into the int8 op's own epilogue

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, fused: bool = True, gemv_rows: int = 0,
                 packed: bool = False):
        """gemv_rows > 0: calls of at most that many rows run `GemvLinear` (int8_gemv).
        packed: the C++ op's product runs our VNNI kernel (decoder/csrc/int8_gemm.cpp) on
        weights packed here (int8_packed_gemm) at calls of at most `packed_rows` rows, `_int_mm`
        above: the same integers, without oneDNN's weight reorder on every call."""
        # fused: one C++ call (decoder/csrc/int8_linear.cpp) instead of ~8 tensor ops
        self.fused = fused and ops.available()
        w = w.float()
        self.w_scale = (w.abs().amax(1).clamp_min(1e-12) / 127.0)  # (out,)
        wq = torch.round(w / self.w_scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (out, in)
        self.wq_t = wq.t().contiguous()  # (in, out)
        self._wq_rows = None  # (out, in), made by the first rows() (the output projection's shortlist)
        self.b = None if b is None else b.float().contiguous()
        # the same integers and scales in the gemv kernel's (out, in) layout
        self.gemv = GemvLinear(wq, self.w_scale, self.b) if gemv_rows and ops.available() else None
        self.gemv_numel = gemv_rows * wq.shape[1]  # x.numel() at which a call still takes gemv
        self.packed, self.packed_rows = None, self.PACKED_ROWS
        if packed and self.fused and ops.int8_gemm_available():
            self.packed = ops.int8_gemm_pack(wq)  # (bytes,) int8, decoder/csrc/int8_gemm.cpp

    # Calls of at most this many rows take the packed product (int8_packed_gemm): it saves
    # `_int_mm`'s per-call weight reorder, 1.1-1.9x at 8-40 rows, 1.02-1.03x at 160 (every
    # layer shape of the KD student, one thread, AVX-512 VNNI EPYC), a tie at 256-1,500 rows
    # but for the 4,450-column projection (0.86-0.9x, never that many rows a step): the
    # encoder's big batches stay on _int_mm, every decode step (beam 4 x 40: 160) takes it. The
    # packed product now dequantises from its tiles (the int32 never stored); the encoder on it
    # too was still a tie: 0.998x a KD student's pass (2026-11-26, 2 threads, int8, shortlist)
    PACKED_ROWS = 256

    @property
    def out_features(self) -> int:
        return self.wq_t.shape[1]

    def _packed(self, numel: int) -> torch.Tensor | None:
        """The packed weights for a call on `numel` activations, if that call takes them."""
        return self.packed if self.packed is not None and numel <= self.packed_rows * self.wq_t.shape[0] else None

    def rows(self, idx: torch.Tensor, batch_rows: int = 64) -> "Int8Linear | GemvLinear":
        """This layer restricted to the output features idx (C,): weights, scales and
        bias sliced together, so the result equals those columns of the full output
        at every row count. A row gather (and, with int8_packed_gemm, those rows packed
        again: 0.23 ms at 4,450 of 8,000, against 30-40 us saved a step at 40 rows): cheap
        enough per batch. Batches of at most the gemv rows get the gemv layout's rows alone."""
        if self.gemv is not None and batch_rows * self.wq_t.shape[0] <= self.gemv_numel:
            return self.gemv.rows(idx)
        new = Int8Linear.__new__(Int8Linear)
        new.fused = self.fused
        new.w_scale = self.w_scale.index_select(0, idx)  # (C,)
        # a row gather of the (out, in) copy, passed to _int_mm as a transposed view: as fast
        # there as (in, C) contiguous, where gathering C columns of (in, out) took 2.6 ms a
        # batch at the KD student's 4,450 of 8,000 (70x the row gather)
        if self._wq_rows is None:
            self._wq_rows = self.wq_t.t().contiguous()  # (out, in)
        new.wq_t = self._wq_rows.index_select(0, idx).t()  # (in, C) view
        new._wq_rows = None
        new.b = None if self.b is None else self.b.index_select(0, idx)
        new.packed_rows = self.packed_rows
        new.packed = self._packed_slice(idx) if self.packed is not None and batch_rows <= self.packed_rows else None
        # early stop shrinks a batch to its last few rows: they run gemv, as the full layer's would
        new.gemv, new.gemv_numel = None if self.gemv is None else self.gemv.rows(idx), self.gemv_numel
        return new

    def _packed_slice(self, idx: torch.Tensor) -> torch.Tensor:
        """The packed weights of the output features idx (C,), packed again per batch (226 us
        at 4,450 of 8,000 columns, K 256)."""
        return ops.int8_gemm_pack(self._wq_rows, idx)

    def __call__(self, x: torch.Tensor | QuantRows, relu: bool = False) -> torch.Tensor:
        if isinstance(x, QuantRows):
            return ops.int8_linear_prequantized(x.q, x.s, self.wq_t, self.w_scale, self.b, relu,
                                                self._packed(x.q.numel()))
        if self.gemv is not None and x.numel() <= self.gemv_numel:
            return self.gemv(x, relu)
        if self.fused:
            return ops.int8_linear(x, self.wq_t, self.w_scale, self.b, relu, self._packed(x.numel()))
        y = self.reference(x)
        return y.relu_() if relu else y

    def runs_int_mm(self, x: torch.Tensor) -> bool:
        """Whether a call on x runs the C++ `_int_mm` op (not the gemv kernel nor the reference)."""
        return self.fused and not (self.gemv is not None and x.numel() <= self.gemv_numel)

    def quantized(self, x: torch.Tensor, relu: bool = False) -> QuantRows:
        """self(x, relu) quantised for the next int8 linear, in this call's own epilogue: the
        float output is never written (the same bits as quantising it; needs `runs_int_mm(x)`)."""
        return QuantRows(*ops.int8_linear_quantized(x, self.wq_t, self.w_scale, self.b, relu,
                                                    self._packed(x.numel())))

    def mm(self, x: torch.Tensor | QuantRows) -> torch.Tensor:
        """Without the bias: a fused op downstream adds it."""
        if isinstance(x, QuantRows):
            return ops.int8_linear_prequantized(x.q, x.s, self.wq_t, self.w_scale, None, False,
                                                self._packed(x.q.numel()))
        if self.gemv is not None and x.numel() <= self.gemv_numel:
            return self.gemv.mm(x)
        if self.fused:
            return ops.int8_linear(x, self.wq_t, self.w_scale, None, False, self._packed(x.numel()))
        return self.reference(x, bias=False)

    def reference(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The PyTorch definition the fused op is tested against (the `_int_mm` path, any rows)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # (M, in)
        # few, in-place passes: at decode shapes the elementwise work rivals the matmul
        amax = x2.abs().amax(1, keepdim=True).clamp_min_(1e-12)  # (M, 1)
        xq = torch.mul(x2, inv_scale(amax)).round_().to(torch.int8)
        y = torch._int_mm(xq, self.wq_t).float()  # (M, out)
        y.mul_(amax.mul_(1.0 / 127.0))
        if self.b is None or not bias:
            y.mul_(self.w_scale)
        else:
            torch.addcmul(self.b, y, self.w_scale, out=y)
        return y.view(*shape[:-1], -1)


class GemvLinear:
    """int8 linear for a few rows a call (batch-1 decoding): our C++ kernel
    (decoder/csrc/int8_gemv.cpp), a dot product per output row with no packing,
    no threads and no quantisation parameters beyond one abs-max per row.

    Same weights as `FbgemmLinear` and `Int8Linear` (int8, one symmetric scale
    per output row; both hold one for their few-row calls), kept (out, in) row
    major, zero-padded to 64 columns and 4 rows. Each row of x gets its own
    symmetric scale (q = round(127 x / amax) in [-127, 127]):
    per tensor, as fbgemm does, would make a sentence's output depend on its
    batch-mates and costs one more pass; per row costs nothing at these sizes.
    `w_shift` (128 x the row sums) is what VNNI's shifted u8 activations add;
    the kernel starts its int32 sums at minus it, so every ISA path returns
    exactly sum q * w and the same float output (`reference`)."""
    dense = False  # bias and relu are in the kernel's epilogue

    def __init__(self, wq: torch.Tensor, w_scale: torch.Tensor, b: torch.Tensor | None):
        n, k = self.shape = wq.shape
        self.wq = F.pad(wq, (0, -k % 64, 0, -n % 4)).contiguous()  # (out padded to 4, in padded to 64)
        self.w_scale = w_scale.float().contiguous()  # (out,)
        self.w_shift = (self.wq.sum(1, dtype=torch.int32) * 128).contiguous()  # (out padded,) int32
        self.b = None if b is None else b.float().contiguous()
        self.isa = gemv_isa_cap()

    @property
    def out_features(self) -> int:
        return self.w_scale.shape[0]

    def __call__(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return ops.int8_gemv(x, self.wq, self.w_scale, self.w_shift, self.b, relu, self.isa)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int8_gemv(x, self.wq, self.w_scale, self.w_shift, None, False, self.isa)

    def rows(self, idx: torch.Tensor, batch_rows: int = 1) -> "GemvLinear":
        """The output features idx (C,) only: row slices, no packing (a shortlist at batch 1,
        once per sentence). The weights are already padded to 64 columns, and the kernel
        computes but never writes the rows past C, so the padding rows repeat idx[0]:
        four index_selects and nothing else (re-padding and re-summing the shift cost
        as much as the slices)."""
        C = idx.numel()
        padded = idx if C % 4 == 0 else torch.cat([idx, idx[:1].expand(-C % 4)])  # (Cp,)
        new = GemvLinear.__new__(GemvLinear)
        new.shape, new.isa = (C, self.shape[1]), self.isa
        new.wq = self.wq.index_select(0, padded)  # (Cp, Kp)
        new.w_shift = self.w_shift.index_select(0, padded)  # (Cp,)
        new.w_scale = self.w_scale.index_select(0, idx)  # (C,)
        new.b = None if self.b is None else self.b.index_select(0, idx)
        return new

    def reference(self, x: torch.Tensor, bias: bool = True, relu: bool = False) -> torch.Tensor:
        """The kernel's math in tensor ops: the same integers, the same float roundings."""
        shape, (n, k) = x.shape, self.shape
        x2 = x.reshape(-1, k).float()  # (M, in)
        amax = x2.abs().amax(1, keepdim=True).clamp_min_(1e-12)  # (M, 1)
        q = torch.mul(x2, inv_scale(amax)).round_()  # (M, in), integers in [-127, 127]
        acc = q.long() @ self.wq[:n, :k].long().t()  # (M, out) exact
        y = acc.float().mul_(amax.mul_(1.0 / 127.0) * self.w_scale)  # rounded once, then the bias once
        if bias and self.b is not None:
            y.add_(self.b)
        if relu:
            y.relu_()
        return y.view(*shape[:-1], n)


def inv_scale(amax: torch.Tensor) -> torch.Tensor:
    """127 / amax rounded once, as the C++ kernels compute it: `127.0 / amax` is
    ATen's reciprocal times 127, two roundings, which moved an x * 127 / amax that
    lands exactly on .5 to the other integer (one activation in a batch, a 1e-3
    change in its output row, a flipped token on the trained fixture)."""
    return torch.full_like(amax, 127.0).div_(amax)


def gemv_isa_cap() -> int:
    """The widest int8_gemv path allowed: ATEN_CPU_CAPABILITY=avx2 (or default)
    caps ours with ATen's, so an ISA-capped benchmark runs AVX2 (plain) code."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return {"default": 0, "avx2": 1}.get(cap, 2)


class FbgemmLinear:
    """Dynamic int8 through fbgemm's prepacked `quantized::linear_dynamic`.

    Same weights as `Int8Linear` (int8, one symmetric scale per output row),
    packed once at load time into fbgemm's blocked layout. Activations are
    quantised per call to uint8 with one scale and zero point per tensor, and
    multiplied u8 x s8: `vpmaddubsw` on AVX2 and AVX-512, `vpdpbusd` with VNNI,
    picked by fbgemm from its own cpuinfo (`FBGEMM_ENABLE_INSTRUCTIONS=AVX2`
    caps it). `vpmaddubsw` adds pairs of products into int16 and saturates past
    32767, so without VNNI the activations use 7 bits (`reduce_range`, as
    torch.ao's dynamic Linear does); VNNI accumulates in int32 and keeps 8."""
    dense = False  # the bias is in the packed weight, relu in fbgemm's epilogue

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, gemv_rows: int = 0):
        """gemv_rows > 0: calls of at most that many rows run `GemvLinear` (int8_gemv)."""
        w = w.float()
        self.w_scale = w.abs().amax(1).clamp_min(1e-12) / 127.0  # (out,)
        self.wq = torch.round(w / self.w_scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (out, in)
        self.b = None if b is None else b.float().contiguous()
        self.packed = _pack(self.wq, self.w_scale, self.b)
        self._packed_nobias = None
        self.zero_b = None if b is None else torch.zeros_like(self.b)  # fused ops downstream: bias already in
        self.reduce_range = not fbgemm_vnni()
        self.gemv = GemvLinear(self.wq, self.w_scale, self.b) if gemv_rows and ops.available() else None
        self.gemv_numel = gemv_rows * self.wq.shape[1]  # x.numel() at which a call still takes gemv

    @property
    def out_features(self) -> int:
        return self.wq.shape[0]

    REPACK_ROWS = 8  # below this many rows a step, the sliced projection runs in fp32

    def rows(self, idx: torch.Tensor, batch_rows: int = 64) -> "FbgemmLinear | Linear":
        """The output features idx (C,) only: a shortlist's projection, once per
        batch. Packing costs ~1.5 us per row of C (docs/bench/decoder.md), which a
        batch of `batch_rows` >= REPACK_ROWS rows earns back within a few steps;
        one sentence does not, so it gets those int8 rows dequantised to fp32
        (same weights, no packing: 1.1 ms against 2.4 ms repacked for 30 steps
        over 1000 candidates at d256), or with int8_gemv, which needs no
        packing, the int8 rows sliced for our kernel."""
        if self.gemv is not None and batch_rows * self.wq.shape[1] <= self.gemv_numel:
            return self.gemv.rows(idx)
        if batch_rows < self.REPACK_ROWS:
            w = self.wq.index_select(0, idx).float().mul_(self.w_scale.index_select(0, idx)[:, None])  # (C, in)
            return Linear(w, None if self.b is None else self.b.index_select(0, idx), torch.float32)
        new = FbgemmLinear.__new__(FbgemmLinear)
        new.w_scale, new.wq = self.w_scale.index_select(0, idx), self.wq.index_select(0, idx)
        new.b = None if self.b is None else self.b.index_select(0, idx)
        new.packed, new._packed_nobias = _pack(new.wq, new.w_scale, new.b), None
        new.zero_b = None if new.b is None else torch.zeros_like(new.b)
        new.reduce_range = self.reduce_range
        # the same columns as the full layer's at every row count (early stop shrinks batches)
        new.gemv, new.gemv_numel = None if self.gemv is None else self.gemv.rows(idx), self.gemv_numel
        return new

    def __call__(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        if self.gemv is not None and x.numel() <= self.gemv_numel:
            return self.gemv(x, relu)
        op = torch.ops.quantized.linear_relu_dynamic if relu else torch.ops.quantized.linear_dynamic
        return op(x, self.packed, self.reduce_range)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """Without the bias (a fused op downstream adds it): a second packing, made on first use."""
        if self.gemv is not None and x.numel() <= self.gemv_numel:
            return self.gemv.mm(x)
        if self._packed_nobias is None:
            self._packed_nobias = _pack(self.wq, self.w_scale, None)
        return torch.ops.quantized.linear_dynamic(x, self._packed_nobias, self.reduce_range)


def _pack(wq: torch.Tensor, w_scale: torch.Tensor, b: torch.Tensor | None):
    """fbgemm's packed weight for int8 wq (out, in) with per-row scales."""
    with warnings.catch_warnings():
        # quantised tensor types are deprecated (pytorch#184982), but this one is
        # a transient handle for linear_prepack, which is how fbgemm takes weights
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            wq, w_scale.double(), torch.zeros(wq.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, b)


def fbgemm_available() -> bool:
    """fbgemm is in this torch build (x86); sets it as the quantised engine, once."""
    if "fbgemm" not in _fbgemm:
        engines = torch.backends.quantized.supported_engines
        ok = "x86" in engines or "fbgemm" in engines
        if ok:  # "x86" is fbgemm for dynamic linears; pre-2.0 builds only name fbgemm
            torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"
        _fbgemm["fbgemm"] = ok
    return _fbgemm["fbgemm"]


def fbgemm_vnni() -> bool:
    """Whether fbgemm runs VNNI kernels here: its cpuinfo sees avx512_vnni and
    FBGEMM_ENABLE_INSTRUCTIONS does not force an older ISA."""
    forced = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper()
    if forced in ("AVX2", "AVX512", "AVX512_256"):
        return False
    return _cpu_has_vnni()


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still allow its AVX-512 VNNI int8 kernels
ONEDNN_VNNI_CAPS = ("ALL", "DEFAULT", "AVX512_CORE_", "AVX10")


def int_mm_vnni() -> bool:
    """Whether `torch._int_mm` (oneDNN's int8 matmul, `Int8Linear`) runs VNNI
    here: the CPU has avx512_vnni and neither ATen (ATEN_CPU_CAPABILITY=avx2 or
    default) nor oneDNN (ONEDNN_MAX_CPU_ISA below AVX512_CORE_VNNI) is capped
    under it. Without VNNI `_int_mm` is 13-30x slower than fp32 (a plain loop),
    so the switch `int8_vnni_int_mm` (decoder/optimisations.py) asks this."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        return False
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap and not cap.startswith(ONEDNN_VNNI_CAPS):
        return False  # SSE41, AVX, AVX2, AVX2_VNNI(_2), AVX512_CORE: no AVX-512 VNNI
    return _cpu_has_vnni()


@functools.cache
def _cpu_has_vnni() -> bool:
    """Read once: every FbgemmLinear of a model asks (unreadable: False, 7-bit activations run everywhere)."""
    return "avx512_vnni" in machine.cpu_info()["flags"]


_fbgemm: dict = {}


def make_linear(w: torch.Tensor, b: torch.Tensor | None, precision: str, plan=None):
    """The linear layer of `precision`; int8 runs the kernels the plan chose
    (`plan.int8_kernel`, decoder/optimisations.py: fbgemm or our `_int_mm` op,
    `plan.int8_gemv_rows`: our gemv kernel at that many rows or fewer, and
    `plan.int8_packed_gemm`: our packed VNNI product in place of `_int_mm`)."""
    if precision != "int8":
        return Linear(w, b, DTYPES[precision])
    gemv_rows = 0 if plan is None else plan.int8_gemv_rows
    if plan is not None and plan.int8_kernel == "fbgemm" and fbgemm_available():
        return FbgemmLinear(w, b, gemv_rows=gemv_rows)
    return Int8Linear(w, b, fused=plan is None or plan.int8_fused, gemv_rows=gemv_rows,
                      packed=plan is not None and plan.int8_packed_gemm)


def describe_int8(kernel: str) -> str:
    """The int8 product `make_linear` builds for the plan's `int8_kernel`, for the settings
    line: fbgemm without VNNI has 7-bit activations, which flip 2-5x the lines that the
    8-bit kernels flip near ties (docs/bench/decoder.md "7-bit activations")."""
    if kernel == "fbgemm" and fbgemm_available():
        return "fbgemm, 8-bit activations" if fbgemm_vnni() else "fbgemm, 7-bit activations (no VNNI)"
    return "_int_mm, 8-bit activations"
