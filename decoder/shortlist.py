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

    def __init__(self, offsets, ids, frequent, eos_id: int, device, candidates=None):
        """`candidates`: the plan's bound op (decoder/fused.py `Ops.shortlist_candidates`,
        the C++ kernel's entry or `candidates_reference`); None: the reference."""
        always = torch.cat([frequent, torch.tensor([eos_id])])
        _check_lists(offsets, ids, always)  # once, where the lists are born: the step then reads them unchecked
        self.offsets, self.ids = offsets.to(device), ids.to(device)  # CSR: (V+1,), (nnz,)
        self.always = always.to(device)  # (N+1,)
        self.vocab_size = offsets.numel() - 1
        self.op = candidates or candidates_reference

    def candidates(self, src):
        """src (B, S) source ids -> the allowed target ids (C,), ascending, </s> among them."""
        return self.op(src, self.offsets, self.ids, self.always)

    def candidates_reference(self, src):
        return candidates_reference(src, self.offsets, self.ids, self.always)


def candidates_reference(src, offsets, ids, always):
    """Shortlist.candidates in tensor ops (any device); decoder/csrc/shortlist.cpp is the CPU kernel.
    src (B, S), CSR offsets (V+1,) into ids (nnz,), always (N,) -> (C,) ascending."""
    u = torch.unique(src)  # (U,)
    start, n = offsets[u], offsets[u + 1] - offsets[u]  # (U,) each
    # index of every listed id: start[i] + 0 .. n[i]-1, flattened over i
    first = torch.cumsum(n, 0) - n  # (U,) where source i's run begins in the flat list
    pos = torch.repeat_interleave(start - first, n) + torch.arange(int(n.sum()), device=src.device)
    allowed = torch.zeros(offsets.numel() - 1, dtype=torch.bool, device=src.device)
    allowed[ids[pos]] = True
    allowed[always] = True
    return allowed.nonzero()[:, 0]  # (C,)


def candidates_kernel(src, offsets, ids, always):
    """The C++ op's entry (CPU tensors). The source ids are checked here, not only by the
    op's own check: a C++ exception crashed some builds (issue 30); once per batch."""
    V = offsets.numel() - 1
    lo, hi = torch.aminmax(src) if src.numel() else (0, -1)
    if int(lo) < 0 or int(hi) >= V:
        bad = int(lo) if int(lo) < 0 else int(hi)
        raise ops.OpArgumentError(f"shortlist_candidates: source id {bad} outside the vocabulary of {V}")
    return torch.ops.decoder_ops.shortlist_candidates(src, offsets, ids, always)


def _check_lists(offsets, ids, always) -> None:
    """What shortlist_candidates reads without bounds: offsets ascending within ids, every
    id within the vocabulary; an ops.OpArgumentError (a ValueError) otherwise. A model dir's
    file is refused before this, with its name (decoder/modeldir.py): this is for lists
    built in code."""
    if not all(t.dtype == torch.long and t.dim() == 1 for t in (offsets, ids, always)) or offsets.numel() < 1:
        raise ops.OpArgumentError("shortlist: offsets (V+1,), ids (nnz,) and frequent (N,) must be 1-d int64")
    V = offsets.numel() - 1
    if int(offsets[0]) < 0 or int(offsets[-1]) > ids.numel() or bool((offsets[1:] < offsets[:-1]).any()):
        raise ops.OpArgumentError(f"shortlist: offsets must ascend from 0 within the {ids.numel()} ids")
    for what, t in (("target", ids), ("always-allowed", always)):
        bad = t[(t < 0) | (t >= V)]
        if bad.numel():
            raise ops.OpArgumentError(f"shortlist_candidates: {what} id {int(bad[0])} outside the vocabulary of {V}")
