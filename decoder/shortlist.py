"""Lexical shortlist: the target ids a batch may produce (student/shortlist builds the file)."""
from __future__ import annotations

import torch

from . import ops


class Shortlist:
    """Vocabulary selection: the target ids a batch may produce.

    The union, over the batch's source tokens, of their shortlists, plus the
    frequent ids and </s>. One union per batch (Marian, CTranslate2): per
    sentence would mean a different projection per row, i.e. no single matmul.
    """

    def __init__(self, offsets, ids, frequent, eos_id: int, device):
        self.offsets, self.ids = offsets.to(device), ids.to(device)  # CSR: (V+1,), (nnz,)
        self.always = torch.cat([frequent, torch.tensor([eos_id])]).to(device)  # (N+1,)
        self.vocab_size = offsets.numel() - 1

    def candidates(self, src):
        """src (B, S) source ids -> the allowed target ids (C,), ascending, </s> among them."""
        if src.device.type == "cpu" and ops.available():
            return torch.ops.decoder_ops.shortlist_candidates(src, self.offsets, self.ids, self.always)
        return self.candidates_reference(src)

    def candidates_reference(self, src):
        """`candidates` in tensor ops (any device); decoder/csrc/shortlist.cpp is the CPU kernel."""
        u = torch.unique(src)  # (U,)
        start, n = self.offsets[u], self.offsets[u + 1] - self.offsets[u]  # (U,) each
        # index of every listed id: start[i] + 0 .. n[i]-1, flattened over i
        first = torch.cumsum(n, 0) - n  # (U,) where source i's run begins in the flat list
        pos = torch.repeat_interleave(start - first, n) + torch.arange(int(n.sum()), device=src.device)
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool, device=src.device)
        allowed[self.ids[pos]] = True
        allowed[self.always] = True
        return allowed.nonzero()[:, 0]  # (C,)
