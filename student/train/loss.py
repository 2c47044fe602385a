"""Label-smoothed cross-entropy (Szegedy et al.; fairseq's form, summed over tokens)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_id: int):
    """(smoothed loss sum, nll sum, n tokens) over non-pad targets.

    logits: (B, T, V), target: (B, T). The smoothing mass eps is spread
    uniformly over the vocabulary, the true class keeping 1 - eps + eps/V.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.shape[-1])  # (N, V)
    target = target.reshape(-1)
    keep = target != pad_id
    lprobs, target = lprobs[keep], target[keep]
    nll = -lprobs.gather(1, target[:, None]).squeeze(1)  # (n,)
    smooth = -lprobs.mean(-1)                            # (n,) cross-entropy with uniform
    loss = (1.0 - eps) * nll + eps * smooth
    return loss.sum(), nll.sum(), int(keep.sum())
