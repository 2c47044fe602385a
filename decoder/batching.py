"""Length-sorted batches under a token budget; order is restored in one place."""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch


def make_batches(lengths: list[int], max_tokens: int, max_sentences: int,
                 sort: bool = True) -> list[list[int]]:
    """Indices into `lengths`, grouped so that padded size (rows x longest) stays
    within max_tokens and rows within max_sentences. Sorting by length (longest
    first, so the biggest batch meets memory limits at once) wastes little padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if sort else list(range(len(lengths)))
    return pack(order, lengths, max_tokens, max_sentences)


def pack(order, lengths, max_tokens: int, max_sentences: int) -> list[list[int]]:
    """Cut `order` (indices into lengths) into consecutive batches: each grows while
    rows x longest stays within max_tokens and rows within max_sentences; an item
    over the budget alone is a batch of its own. The one packing rule of the kit:
    training and the reference searches choose only the order."""
    batches, cur, longest = [], [], 0
    for i in order:
        n = lengths[i]
        if cur and (max(longest, n) * (len(cur) + 1) > max_tokens or len(cur) >= max_sentences):
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def restore(batches: list[list[int]], results: list[list], n: int) -> list:
    """Put per-batch results back in input order."""
    out: list = [None] * n
    for idx, res in zip(batches, results):
        for i, r in zip(idx, res):
            out[i] = r
    return out


def padded(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """seqs as one (rows, longest) int64 tensor, right-padded with pad_id: one numpy fill
    where a row at a time costs three tensor ops each (25 against 2.7 ms at 4,096 rows)."""
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    out = np.full((len(seqs), int(lens.max(initial=0))), pad_id, dtype=np.int64)  # (rows, S)
    # chain, not a generator expression: 1.2 against 2.0 ms at 2,048 rows of 42 tokens
    out[np.arange(out.shape[1]) < lens[:, None]] = np.fromiter(
        chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    return torch.from_numpy(out)
