"""Fused decode-step ops: the C++ kernels (decoder/csrc/fused_cpu.cpp) beside
their plain PyTorch definitions.

Each op has its reference, its kernel's entry (`*_kernel`: the argument checks
in Python, then the op; `*_cuda` where CUDA's kernel differs) and a public
function that runs the entry when the library for the tensor's device is built
(decoder/ops.py: C++ for CPU, csrc/fused_cuda.cu for CUDA where nvcc is found)
and the reference otherwise; the tests check one against the other. The decoder
asks that once: its plan (decoder/optimisations.py) holds the `Ops` that `bound`
chose for its device, dtype and loaded kernels, and whether it uses each fusion
is a switch, so the benchmarks measure every fusion alone.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import ops
from .shortlist import candidates_kernel as shortlist_candidates_kernel
from .shortlist import candidates_reference as shortlist_candidates_reference


def add_bias_residual_layernorm_reference(x, h, bias, gamma, beta, eps: float):
    """(r, y): r = x + h (+ bias), y = LayerNorm(r); the pre-norm residual step."""
    r = x + h if bias is None else x + h + bias
    return r, F.layer_norm(r, (r.shape[-1],), gamma, beta, eps)


def log_softmax_topk_reference(logits, scores, K: int, n: int, normalized: bool = False):
    """logits (S*K, V), scores (S*K,) -> the n best (values, indices in [0, K*V)) per sentence
    of log_softmax(logits) + score; `normalized`: the logits are log-probs already."""
    R, V = logits.shape
    lp = logits.float() if normalized else torch.log_softmax(logits.float(), -1)  # (S*K, V)
    cand = lp + scores.float()[:, None]  # (S*K, V)
    return cand.view(R // K, K * V).topk(n, dim=1)


def decode_attention_reference(q, k, v, mask=None, rows=None):
    """q (B, H, Q, D) against k, v (B, H, T, D); mask (B, 1, 1, T) bool, True = attend.
    rows (B, T) long: key and value j of row b are those of k's and v's row rows[b, j]
    (beam search's row table, decoder/state.py); k, v are then (N, H, T, D)."""
    if rows is not None:
        pos = torch.arange(k.shape[2], device=k.device)  # (T,)
        # (N, T, H, D)[rows, pos] -> (B, T, H, D)
        k, v = (t.transpose(1, 2)[rows, pos].transpose(1, 2) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def heads(x, h):
    # (B, T, d) -> (B, h, T, hd)
    B, T, d = x.shape
    return x.view(B, T, h, d // h).transpose(1, 2)


def merge(o):
    # (B, h, T, hd) -> (B, T, d)
    B, h, T, hd = o.shape
    return o.transpose(1, 2).reshape(B, T, h * hd)


def attention_heads(q, k, v, mask, h: int):
    """q, k, v (B, S, d) -> SDPA over h heads, merged back to (B, S, d); mask (B, 1, 1, S) bool."""
    return merge(F.scaled_dot_product_attention(heads(q, h), heads(k, h), heads(v, h), attn_mask=mask))


def encoder_attention_reference(qkv, mask, heads: int):
    """The encoder's self-attention from the fused q|k|v product qkv (B, S, 3d); mask
    (B, 1, 1, S) bool, True = attend -> (B, S, d), the heads merged."""
    return attention_heads(*qkv.chunk(3, dim=-1), mask, heads)


def ngram_block_reference(logits, hist, n: int, vocab=None):
    """In place: -inf for every token that would repeat an n-gram already in the
    row's history hist (R, T) (fairseq's no_repeat_ngram_size). With a shortlist
    the columns are the ids `vocab` (C,), ascending."""
    R, T = hist.shape
    if n < 1 or T == 0 or T < n - 1:
        return logits
    cols = None if vocab is None else {int(v): j for j, v in enumerate(vocab.tolist())}
    for r, row in enumerate(hist.tolist()):
        suffix = row[T - (n - 1):]
        for i in range(T - n + 1):
            if row[i:i + n - 1] == suffix:
                tok = row[i + n - 1]
                col = tok if cols is None else cols.get(tok)
                if col is not None and 0 <= col < logits.shape[1]:
                    logits[r, col] = float("-inf")
    return logits


def argmax_rows_reference(logits):
    """logits (R, C) -> (R,) the first column of each row's maximum (NaN counts as largest)."""
    return logits.argmax(-1)


def linear_argmax_reference(x, weight, bias=None, chunk: int = 0):
    """x (R, d), weight (V, d) -> (R,) argmax of the projection, through the full logits."""
    return F.linear(x, weight, bias).argmax(-1)


require = ops.require  # argument checks before a kernel runs (decoder/ops.py says why)


def _kernel(t: torch.Tensor) -> bool:
    """Whether the library for t's device is loaded: the public wrappers below ask per
    call; the decoder asked once, in `bound`, when its plan was resolved."""
    if t.device.type == "cpu":
        return ops.available()
    return t.device.type == "cuda" and _cuda_kernels()


_cuda: dict = {}
# kernels with a CUDA kernel of their own to fall back to: one that disagrees is refused alone
OWN_FALLBACK = {"decode_attention_rows": "the K/V cache moved at each beam reorder (kv_row_table off)"}


def _cuda_kernels() -> bool:
    """The CUDA kernels, once built, are compared with their references once per
    process: a kernel that went wrong on some GPU is never used there."""
    ok = _cuda.get("ok")
    if ok is None:
        ok = ops.cuda_available()
        try:
            bad = self_check("cuda") if ok else []
        except Exception as e:  # the check itself failed (a kernel's launch, its memory): none is trusted
            bad = [f"the self-check stopped: {(str(e).strip().splitlines() or [type(e).__name__])[0]}"]
        for name in [b for b in bad if b in OWN_FALLBACK]:
            print(f"warning: the CUDA kernel {name} disagrees with its reference; CUDA uses {OWN_FALLBACK[name]}",
                  file=sys.stderr, flush=True)
        _cuda["refused"] = frozenset(bad)
        bad = [b for b in bad if b not in OWN_FALLBACK]
        if bad:
            print(f"warning: fused CUDA kernels disagree with their references ({', '.join(bad)}); "
                  f"CUDA uses the PyTorch reference", file=sys.stderr, flush=True)
            ok = False
            ops.cuda_refused(f"disagree with their references: {', '.join(bad)}")
        _cuda["ok"] = ok
    return ok


def cuda_refused_alone() -> frozenset:
    """The CUDA kernels of OWN_FALLBACK that their self-check refused while the others run."""
    return frozenset(_cuda.get("refused", ())) & OWN_FALLBACK.keys() if _cuda_kernels() else frozenset()


def status() -> dict:
    """ops.status() once the CUDA kernels, where they built, passed or failed their self-check."""
    if ops.status()["cuda"]:
        _cuda_kernels()
    return ops.status()


def describe() -> str:
    """status() as the decoder's settings line and `make setup` print it:
    'fused ops: cpu yes (avx512 kernels), cuda no (no GPU)', the cap named where one is set."""
    s = status()
    say = {k: "yes" if s[k] else f"no ({s[k + '_why']})" for k in ("cpu", "cuda")}
    if s["cpu"]:
        cap = os.environ.get(ops.ISA_CAP, "")
        say["cpu"] += f" ({s['cpu_isa']} kernels{f', {ops.ISA_CAP}={cap}' if cap else ''})"
    return f"fused ops: cpu {say['cpu']}, cuda {say['cuda']}"


# -- the kernels' entries: the argument checks in Python, then the op (bad input must not rely
#    on a C++ exception crossing into Python); which entry runs is decided once, in `bound` --

def add_bias_residual_layernorm_kernel(x, h, bias, gamma, beta, eps: float):
    n = x.shape[-1]
    require(h.shape == x.shape and gamma.numel() == n and beta.numel() == n and (bias is None or bias.numel() == n),
            lambda: f"add_bias_residual_layernorm: x and h must have one shape, the norm weights and bias "
                    f"{n} elements")
    return torch.ops.decoder_ops.add_bias_residual_layernorm(x, h, bias, gamma, beta, eps)


CUDA_MAX_TOP = 16  # the CUDA kernel keeps n <= 16 candidates per thread (beam <= 8); kMaxTop in fused_cuda.cu


def _check_topk(logits, scores, K: int, n: int):
    require(logits.dim() == 2, "log_softmax_topk: logits must be (rows, V)")
    R, V = logits.shape
    require(K > 0 and R % K == 0, lambda: f"log_softmax_topk: {R} rows are not a multiple of K={K}")
    require(scores.numel() == R, lambda: f"log_softmax_topk: one score per row ({R}), got {scores.numel()}")
    require(0 < n <= K * V, lambda: f"log_softmax_topk: n must be in [1, K*V = {K * V}], got {n}")


def log_softmax_topk_kernel(logits, scores, K: int, n: int, normalized: bool = False):
    _check_topk(logits, scores, K, n)
    return torch.ops.decoder_ops.log_softmax_topk(logits, scores, K, n, normalized)


def log_softmax_topk_cuda(logits, scores, K: int, n: int, normalized: bool = False):
    _check_topk(logits, scores, K, n)
    # n is an argument: a caller may ask any n; the decoder's is 2 x beam, so this branch
    # is the same at every step of a plan (beams above 8 take the reference)
    if n > CUDA_MAX_TOP:
        return log_softmax_topk_reference(logits, scores, K, n, normalized)
    return torch.ops.decoder_ops.log_softmax_topk(logits, scores, K, n, normalized)


def _log_softmax_topk_checked(logits, scores, K: int, n: int, normalized: bool = False):
    """The reference behind the kernel's checks: the same error for bad input either way."""
    _check_topk(logits, scores, K, n)
    return log_softmax_topk_reference(logits, scores, K, n, normalized)


def _check_ngram(logits, hist):
    require(logits.dim() == 2 and hist.dim() == 2 and hist.shape[0] == logits.shape[0],
            "ngram_block_: logits (R, C) and hist (R, T) must have the same rows")


def ngram_block_kernel(logits, hist, n: int, vocab=None):
    _check_ngram(logits, hist)
    # the kernel writes rows of stride 1: the decoder's logits always are, a caller's view may not be
    if not logits.is_contiguous():
        return ngram_block_reference(logits, hist, n, vocab)
    torch.ops.decoder_ops.ngram_block_(logits, hist, n, vocab)
    return logits


def _ngram_block_checked(logits, hist, n: int, vocab=None):
    """The reference behind the kernel's checks."""
    _check_ngram(logits, hist)
    return ngram_block_reference(logits, hist, n, vocab)


CUDA_MAX_KEYS = 48 * 1024 // 4  # the CUDA kernel holds a row's T scores in 48 KB of shared memory


def decode_attention_kernel(q, k, v, mask=None, rows=None):
    """The CPU kernels: through beam search's row table `rows`, or the plain one."""
    _check_attention(q, k, v, mask, rows)
    if rows is not None:
        return torch.ops.decoder_ops.decode_attention_rows(q, k, v, rows, mask)
    return torch.ops.decoder_ops.decode_attention(q, k, v, mask)


def decode_attention_cuda(q, k, v, mask=None, rows=None):
    # the keys grow by one a step: past CUDA_MAX_KEYS (12k, beyond any output cap) the reference
    if k.shape[2] > CUDA_MAX_KEYS:
        return decode_attention_reference(q, k, v, mask, rows)
    _check_attention(q, k, v, mask, rows)
    if rows is not None:
        return torch.ops.decoder_ops.decode_attention_rows(q, k, v, rows, mask)
    return torch.ops.decoder_ops.decode_attention(q, k, v, mask)


def _check_attention(q, k, v, mask, rows=None):
    require(q.dim() == 4 and k.dim() == 4 and v.shape == k.shape and k.shape[1] == q.shape[1]
            and k.shape[3] == q.shape[3] and (rows is not None or k.shape[0] == q.shape[0]),
            lambda: f"decode_attention: q (B, H, Q, D) and k, v (B, H, T, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
                    f"{tuple(v.shape)}")
    B, T = q.shape[0], k.shape[2]
    require(mask is None or (mask.numel() == B * T and mask.dtype == torch.bool),
            "decode_attention: mask must be bool (B, 1, 1, T)")
    if rows is not None:
        require(rows.shape == (B, T) and rows.dtype == torch.long and rows.device == k.device,
                lambda: f"decode_attention_rows: rows must be long ({B}, {T}) on the cache's device")
        # on a CPU tensor the values are read where the kernel reads them; a GPU's would cost a host
        # read (which a captured graph cannot make): its kernel clamps each into the cache instead
        if rows.device.type == "cpu":
            lo, hi = torch.aminmax(rows) if rows.numel() else (0, -1)
            require(int(lo) >= 0 and int(hi) < k.shape[0],
                    lambda: f"decode_attention_rows: a row index is outside the cache's {k.shape[0]} rows")


def encoder_attention_kernel(qkv, mask, heads: int):
    # CPU only. 1.2-4x SDPA at every shape on one thread, 1.7-4.2x on two (its (row, head)
    # pairs split over torch's threads; docs/bench/decoder.md)
    require(qkv.dim() == 3 and heads > 0 and qkv.shape[2] % (3 * heads) == 0,
            lambda: f"encoder_attention: qkv must be (B, S, 3 * {heads} heads * D), got {tuple(qkv.shape)}")
    require(mask is None or (mask.numel() == qkv.shape[0] * qkv.shape[1] and mask.dtype == torch.bool),
            "encoder_attention: mask must be bool (B, 1, 1, S)")
    return torch.ops.decoder_ops.encoder_attention(qkv, mask, heads)


def cross_attention_reference(q, k, v, mask=None):
    """The decoder's cross-attention: q (B, Q, d), the Q queries of a sentence (its beams),
    against its cross K/V k, v (B, h, S, hd); mask (B, 1, 1, S) bool, True = attend -> (B, Q, d)."""
    return merge(F.scaled_dot_product_attention(heads(q, k.shape[1]), k, v, attn_mask=mask))


def cross_attention_kernel(q, kt, va, lens):
    """q (B, Q, d) against one batch's arranged cross K/V (CrossAttention)."""
    require(q.dim() == 3 and q.shape[0] == kt.shape[0] and q.shape[2] == kt.shape[1] * kt.shape[2],
            lambda: f"cross_attention: q must be ({kt.shape[0]}, Q, {kt.shape[1] * kt.shape[2]}), "
                    f"got {tuple(q.shape)}")
    return torch.ops.decoder_ops.cross_attention(q, kt, va, lens)


class CrossAttention:
    """A batch's cross K/V arranged once for the C++ op (decoder_ops::cross_arrange: per
    sentence and head the attended keys transposed and padded to register blocks, a key
    count for the mask), then `self(q)` each step: q (B, Q, d) -> (B, Q, d). `kernel`:
    whether the C++ op runs (None: where it is loaded for k's device, CPU only), else the
    reference on the K/V as given; decided here, once per batch, not per step."""

    def __init__(self, k, v, mask=None, kernel: bool | None = None):
        self.kernel = _kernel(k) and k.device.type == "cpu" if kernel is None else kernel
        if self.kernel:
            require(k.dim() == 4 and v.shape == k.shape, "cross_arrange: k and v must be (B, H, S, D), the same")
            require(mask is None or (mask.numel() == k.shape[0] * k.shape[2] and mask.dtype == torch.bool),
                    "cross_arrange: mask must be bool (B, 1, 1, S)")
            # kt (B, h, hd, Sp), va (B, h, S, Dv), lens (B,)
            self.kv = torch.ops.decoder_ops.cross_arrange(k, v, mask)
        else:  # k, v (B, h, S, hd) and the mask
            self.kv = (k, v, mask)
        self.attend = cross_attention_kernel if self.kernel else cross_attention_reference

    def __call__(self, q):
        return self.attend(q, *self.kv)

    def keep(self, sents):
        """Only the sentences `sents` stay: each sentence's arrangement is its own, so it carries over."""
        self.kv = tuple(t if t is None else t.index_select(0, sents) for t in self.kv)


def cross_store_kernel(k, v, mask=None):
    return CrossAttention(k, v, mask, kernel=True)


def cross_store_reference(k, v, mask=None):
    return CrossAttention(k, v, mask, kernel=False)


_ARGMAX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the kernels compare in fp32


def argmax_rows_kernel(logits):
    require(logits.dim() == 2 and logits.shape[1] > 0, "argmax_rows: logits must be (rows, C) with C > 0")
    return torch.ops.decoder_ops.argmax_rows(logits)


def linear_argmax_kernel(x, weight, bias=None, chunk: int = 1024):
    require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and weight.shape[0] > 0,
            "linear_argmax: x (R, d) and weight (V, d) with V > 0")
    require(bias is None or bias.numel() == weight.shape[0], "linear_argmax: bias must have V elements")
    require(chunk > 0, "linear_argmax: chunk must be positive")
    return torch.ops.decoder_ops.linear_argmax(x, weight, bias, chunk)


# -- the ops of one device, bound once ----------------------------------------------------------

@dataclass(frozen=True)
class Ops:
    """The fused ops of one device and dtype, each its kernel's entry or its PyTorch
    reference, chosen once (`bound`): the decoder's plan (decoder/optimisations.py)
    holds these, so its step never asks which of them runs."""
    add_bias_residual_layernorm: Callable
    log_softmax_topk: Callable
    ngram_block_: Callable
    decode_attention: Callable
    encoder_attention: Callable
    cross_store: Callable       # (k, v, mask) -> a batch's cross K/V store, store(q (B, Q, d)) -> (B, Q, d)
    argmax_rows: Callable
    linear_argmax: Callable
    shortlist_candidates: Callable  # (src, offsets, ids, always) -> (C,): decoder/shortlist.py

    def is_kernel(self, name: str) -> bool:
        """Whether op `name` runs a kernel here (CUDA's entries still take the reference
        past a shape limit: CUDA_MAX_TOP, CUDA_MAX_KEYS)."""
        return getattr(self, name) is not getattr(REFERENCE, name)


REFERENCE = Ops(add_bias_residual_layernorm_reference, _log_softmax_topk_checked, _ngram_block_checked,
                decode_attention_reference, encoder_attention_reference, cross_store_reference,
                argmax_rows_reference, linear_argmax_reference,
                shortlist_candidates_reference)
CPU_KERNELS = Ops(add_bias_residual_layernorm_kernel, log_softmax_topk_kernel, ngram_block_kernel,
                  decode_attention_kernel, encoder_attention_kernel, cross_store_kernel,
                  argmax_rows_kernel, linear_argmax_kernel, shortlist_candidates_kernel)
# csrc/fused_cuda.cu has no encoder attention, cross-attention store or shortlist
CUDA_KERNELS = dataclasses.replace(CPU_KERNELS, log_softmax_topk=log_softmax_topk_cuda,
                                   decode_attention=decode_attention_cuda,
                                   encoder_attention=encoder_attention_reference, cross_store=cross_store_reference,
                                   shortlist_candidates=shortlist_candidates_reference)


@functools.lru_cache(maxsize=None)
def bound(device: str, dtype: torch.dtype, loaded: bool) -> Ops:
    """The ops on `device` ("cpu" | "cuda") for tensors of `dtype`, where that device's
    kernels are `loaded` (decoder/optimisations.py `Kernels`); the argmax kernels
    compare in fp32, so other dtypes (float64) take torch's argmax."""
    if not loaded or device not in ("cpu", "cuda"):
        return REFERENCE
    o = CPU_KERNELS if device == "cpu" else CUDA_KERNELS
    if dtype not in _ARGMAX_DTYPES:
        o = dataclasses.replace(o, argmax_rows=argmax_rows_reference, linear_argmax=linear_argmax_reference)
    return o


# -- per tensor: the library API (tools, tests); the decoder calls its plan's bound ops ----------

def _ops(t: torch.Tensor) -> Ops:
    return bound(t.device.type, t.dtype, _kernel(t))


def add_bias_residual_layernorm(x, h, bias, gamma, beta, eps: float):
    return _ops(x).add_bias_residual_layernorm(x, h, bias, gamma, beta, eps)


def log_softmax_topk(logits, scores, K: int, n: int, normalized: bool = False):
    return _ops(logits).log_softmax_topk(logits, scores, K, n, normalized)


def ngram_block_(logits, hist, n: int, vocab=None):
    return _ops(logits).ngram_block_(logits, hist, n, vocab)


def decode_attention(q, k, v, mask=None, rows=None):
    return _ops(q).decode_attention(q, k, v, mask, rows)


def encoder_attention(qkv, mask, heads: int):
    return _ops(qkv).encoder_attention(qkv, mask, heads)


def argmax_rows(logits):
    return _ops(logits).argmax_rows(logits)


def linear_argmax(x, weight, bias=None, chunk: int = 1024):
    return _ops(x).linear_argmax(x, weight, bias, chunk)



class _Probe:
    """One dtype's round of the self-check: draws the inputs, records each op that disagrees."""

    def __init__(self, device, dt, tol, g, call, bad):
        self.device, self.dt, self.tol, self.g, self.call, self.bad = device, dt, tol, g, call, bad

    def rnd(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.device, self.dt)

    def agree(self, name, got, want, tol=None):
        tol = self.tol if tol is None else tol
        ok = all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
                 for a, b in zip(got, want))
        if not ok and name not in self.bad:
            self.bad.append(name)

    def lengths_mask(self, lens, T):  # (B, 1, 1, T): key j of row b is seen when j < lens[b]
        return (torch.arange(T)[None] < lens[:, None])[:, None, None, :].to(self.device)


def _check_norm(p):
    # rows of 512 and 64 (16-byte aligned) take CUDA's warp kernel; of 67, its block kernel
    for shape, with_bias in (((6, 512), False), ((3, 64), True), ((5, 2, 67), True)):
        n = shape[-1]
        x, h, gm, bt = p.rnd(*shape), p.rnd(*shape), p.rnd(n), p.rnd(n)
        b = p.rnd(n) if with_bias else None
        want = add_bias_residual_layernorm_reference(x.float(), h.float(), None if b is None else b.float(),
                                                     gm.float(), bt.float(), 1e-5)
        p.agree("add_bias_residual_layernorm", p.call("add_bias_residual_layernorm", x, h, b, gm, bt, 1e-5), want)


def _check_decode_attention(p):
    q, kv = p.rnd(3, 2, 2, 16), p.rnd(2, 3, 2, 9, 16)
    mask = p.lengths_mask(torch.tensor([9, 4, 1]), 9)
    p.agree("decode_attention", [p.call("decode_attention", q, kv[0], kv[1], mask)],
            [decode_attention_reference(q.float(), kv[0].float(), kv[1].float(), mask)])


def _check_decode_attention_rows(p):
    """Through a row table, with and without a mask, over cache rows other than the queries' own."""
    for B, N, H, T, D in ((3, 5, 2, 9, 16), (6, 6, 2, 40, 64), (130, 130, 4, 12, 40)):
        q, kv = p.rnd(B, H, 1, D), p.rnd(2, N, H, T, D)
        rows = torch.randint(0, N, (B, T), generator=p.g).to(p.device)
        mask = p.lengths_mask(torch.tensor([T, T // 2, 1] * B)[:B], T)
        for m in (mask, None):
            want = decode_attention_reference(q.float(), kv[0].float(), kv[1].float(), m, rows)
            try:
                got = p.call("decode_attention_rows", q, kv[0], kv[1], rows, m)
            except RuntimeError:  # a launch this GPU refuses counts as a wrong answer
                got = torch.full_like(want, float("nan"))
            p.agree("decode_attention_rows", [got], [want])


def _check_log_softmax_topk(p):
    logits = p.rnd(8, 301) * 4
    scores = -torch.rand(8, generator=p.g).to(p.device)
    v, i = p.call("log_softmax_topk", logits, scores, 4, 6)
    cand = (torch.log_softmax(logits.float(), -1) + scores[:, None]).view(2, -1)
    p.agree("log_softmax_topk", [v, cand.gather(1, i)], [log_softmax_topk_reference(logits, scores, 4, 6)[0], v])
    lp = torch.log_softmax(logits.float(), -1)
    v, i = p.call("log_softmax_topk", lp, scores, 4, 6, True)
    # exact values; the indices through what they pick (low-precision logits tie, and a tie's index is either)
    p.agree("log_softmax_topk", [v, (lp + scores[:, None]).view(2, -1).gather(1, i)],
            [log_softmax_topk_reference(lp, scores, 4, 6, True)[0], v], 0)


def _check_ngram_block(p):
    hist = torch.randint(0, 11, (6, 4), generator=p.g).repeat(1, 3).to(p.device)
    lg = p.rnd(6, 11)
    want = ngram_block_reference(lg.clone(), hist, 3)
    p.call("ngram_block_", lg, hist, 3, None)
    p.agree("ngram_block_", [lg], [want], 0)


def _check_argmax(p):
    for C in (1001, 1024):  # CUDA's block kernel, its warp kernel (rows 16-byte aligned)
        lg = p.rnd(7, C)
        lg[3, 5] = lg[3, 900] = lg[3].max() + 1  # a tie: the first index wins
        p.agree("argmax_rows", [p.call("argmax_rows", lg)], [lg.argmax(-1)], 0)
    xs, w, wb = p.rnd(9, 32), p.rnd(1001, 32), p.rnd(1001)
    full = F.linear(xs.float(), w.float(), wb.float())
    got = p.call("linear_argmax", xs, w, wb, 256)
    p.agree("linear_argmax", [full.gather(1, got[:, None])[:, 0]], [full.max(-1).values], 10 * p.tol)


def self_check(device, call=None) -> list[str]:
    """Names of the ops whose kernels on `device` disagree with their references
    on small random inputs (fp32 and fp16 on CUDA, fp32 and bf16 on CPU); [] when
    all agree. `_cuda_kernels` runs it once after building the CUDA kernels, so
    a kernel that went wrong on some GPU is never used there. `call(name, *args)`
    runs an op (default: torch.ops.decoder_ops), which lets the tests plant a bad one."""
    call = call or (lambda name, *a: getattr(torch.ops.decoder_ops, name)(*a))
    checks = (_check_norm, _check_decode_attention, _check_decode_attention_rows,
              _check_log_softmax_topk, _check_ngram_block, _check_argmax)
    half = torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16
    g = torch.Generator().manual_seed(11)
    bad: list[str] = []
    for dt, tol in ((torch.float32, 1e-4), (half, 5e-2)):
        probe = _Probe(device, dt, tol, g, call, bad)
        for check in checks:
            check(probe)
    return bad

