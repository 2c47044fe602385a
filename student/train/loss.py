"""Label-smoothed cross-entropy (Szegedy et al.; fairseq's form, summed over tokens)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_id: int):
    """(smoothed loss sum, nll sum, n tokens) over non-pad targets.

    logits: (B, T, V), target: (B, T). torch's label smoothing spreads eps
    uniformly over the whole vocabulary, the target included (it keeps
    1 - eps + eps/V), as fairseq's label_smoothed_cross_entropy does.
    The nll is for reporting only: it carries no gradient.
    """
    logits = logits.float().flatten(0, 1)  # (N, V)
    target = target.reshape(-1)            # (N,)
    loss = F.cross_entropy(logits, target, ignore_index=pad_id, label_smoothing=eps, reduction="sum")
    with torch.no_grad():
        nll = loss.detach() if eps == 0 else F.cross_entropy(logits, target, ignore_index=pad_id,
                                                              reduction="sum")
    return loss, nll, int((target != pad_id).sum())
