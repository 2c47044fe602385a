"""Fused decode-step ops: the C++ kernels (decoder/csrc/fused_cpu.cpp) beside
their plain PyTorch definitions.

Each public function runs the kernel for CPU tensors when the library is
built (decoder/ops.py) and the reference otherwise (CUDA tensors, no
compiler); the tests check one against the other. Which of them the decoder
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


def _kernel(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and ops.available()


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
