"""Fused decode-step ops: the C++ kernels (decoder/csrc/fused_cpu.cpp) beside
their plain PyTorch definitions.

Each public function runs the kernel when the library for the tensor's
device is built (decoder/ops.py: C++ for CPU, csrc/fused_cuda.cu for CUDA
where nvcc is found) and the reference otherwise; the tests check one against
the other. Which of them the decoder
uses is a switch each (`Options.fused_norm`, `fused_relu`, `fused_topk`), so
the benchmark measures every fusion alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops


def add_bias_residual_layernorm_reference(x, h, bias, gamma, beta, eps: float):
    """(r, y): r = x + h (+ bias), y = LayerNorm(r); the pre-norm residual step."""
    r = x + h if bias is None else x + h + bias
    return r, F.layer_norm(r, (r.shape[-1],), gamma, beta, eps)


def add_bias_relu_reference(x, bias):
    return torch.relu(x + bias)


def log_softmax_topk_reference(logits, scores, K: int, n: int):
    """logits (S*K, V), scores (S*K,) -> the n best (values, indices in [0, K*V)) per sentence."""
    R, V = logits.shape
    cand = torch.log_softmax(logits.float(), -1) + scores.float()[:, None]  # (S*K, V)
    return cand.view(R // K, K * V).topk(n, dim=1)


def decode_attention_reference(q, k, v, mask=None):
    """q (B, H, Q, D) against k, v (B, H, T, D); mask (B, 1, 1, T) bool, True = attend."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def qkv_to_cache_reference(kc, vc, qkv, t: int):
    """qkv (N, 1, 3d) -> q (N, 1, d); k and v written to kc, vc (N, H, T, D) at position t."""
    N, H, _, D = kc.shape
    q, k, v = qkv.chunk(3, dim=-1)
    kc[:, :, t] = k.reshape(N, H, D)
    vc[:, :, t] = v.reshape(N, H, D)
    return q


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


def _kernel(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return ops.available()
    return t.device.type == "cuda" and ops.cuda_available()


def add_bias_residual_layernorm(x, h, bias, gamma, beta, eps: float):
    if _kernel(x):
        return torch.ops.decoder_ops.add_bias_residual_layernorm(x, h, bias, gamma, beta, eps)
    return add_bias_residual_layernorm_reference(x, h, bias, gamma, beta, eps)


def add_bias_relu(x, bias):
    if _kernel(x):
        return torch.ops.decoder_ops.add_bias_relu(x, bias)
    return add_bias_relu_reference(x, bias)


def log_softmax_topk(logits, scores, K: int, n: int):
    if _kernel(logits):
        return torch.ops.decoder_ops.log_softmax_topk(logits, scores, K, n)
    return log_softmax_topk_reference(logits, scores, K, n)


def ngram_block_(logits, hist, n: int, vocab=None):
    if _kernel(logits) and logits.is_contiguous():
        torch.ops.decoder_ops.ngram_block_(logits, hist, n, vocab)
        return logits
    return ngram_block_reference(logits, hist, n, vocab)


def decode_attention(q, k, v, mask=None):
    if _kernel(q):
        return torch.ops.decoder_ops.decode_attention(q, k, v, mask)
    return decode_attention_reference(q, k, v, mask)


def qkv_to_cache_(kc, vc, qkv, t: int):
    if _kernel(qkv):
        return torch.ops.decoder_ops.qkv_to_cache_(kc, vc, qkv, t)
    return qkv_to_cache_reference(kc, vc, qkv, t)


def argmax_rows(logits):
    if _kernel(logits):
        return torch.ops.decoder_ops.argmax_rows(logits)
    return argmax_rows_reference(logits)


def linear_argmax(x, weight, bias=None, chunk: int = 1024):
    if _kernel(x):
        return torch.ops.decoder_ops.linear_argmax(x, weight, bias, chunk)
    return linear_argmax_reference(x, weight, bias)
