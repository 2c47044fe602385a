"""Length-grouped token-budget batches, reproducible from (seed, epoch) alone.

Resume needs no saved batch list: the batches of an epoch are a pure function
of the seed and the epoch number, so the data position is (epoch, index).
They are arrays over the lengths alone; the tokens stay on disk
(student/data/indexed.py) until a batch is collated.
"""
from __future__ import annotations

import numpy as np
import torch


def make_batches(src_lens, tgt_lens, max_tokens: int, max_sentences: int, seed: int, epoch: int,
                 shuffle: bool = True) -> "Batches":
    """The epoch's batches (index arrays); each batch's padded size max(len) * n stays under max_tokens.
    Built from the lengths alone, as arrays: for N pairs, 4N bytes of order and a few bytes a batch."""
    rng = np.random.default_rng([seed, epoch])
    lens = np.maximum(np.asarray(src_lens), np.asarray(tgt_lens))
    # ascending lengths, random tie-break so equal-length sentences mix differently each epoch
    order = np.lexsort((rng.random(len(lens)) if shuffle else np.arange(len(lens)), lens))
    if len(order) < 2 ** 31:  # half the bytes of the one array that lives as long as the epoch
        order = order.astype(np.int32)
    bounds = pack_ascending(lens[order], max_tokens, max_sentences)
    n = len(bounds) - 1
    return Batches(order, bounds, rng.permutation(n) if shuffle else np.arange(n))


def pack_ascending(lens: np.ndarray, max_tokens: int, max_sentences: int) -> np.ndarray:
    """decoder.batching.pack's cuts for lengths in ascending order, as batch bounds (B + 1,).

    Ascending, the newest item is the longest, so a batch [i, k) can take item k while
    lens[k] * (k - i + 1) <= max_tokens and k - i < max_sentences: both grow with k, so
    each cut is a binary search, not a step per item."""
    lens = np.asarray(lens)  # int32 (a copy in int64 would be 8 bytes a pair); products in Python ints
    n, bounds, i = len(lens), [0], 0
    while i < n:
        lo, hi = i + 1, min(n, i + max_sentences)  # items i+1 .. hi-1 may join
        while lo < hi:  # first k in [i+1, hi) that does not fit, else hi
            mid = (lo + hi) // 2
            if int(lens[mid]) * (mid - i + 1) > max_tokens:
                hi = mid
            else:
                lo = mid + 1
        i = lo
        bounds.append(i)
    return np.asarray(bounds, dtype=np.int64)


class Batches:
    """An epoch's batches as arrays: batch k is order[bounds[p]:bounds[p + 1]] with p = perm[k].
    Indexing gives an int64 array; slicing (a rank's share, an accumulation group) a Batches."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray, perm: np.ndarray):
        self.order, self.bounds, self.perm = order, bounds, perm

    def __len__(self):
        return len(self.perm)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Batches(self.order, self.bounds, self.perm[k])
        p = int(self.perm[k])
        return self.order[self.bounds[p]:self.bounds[p + 1]].astype(np.int64)

    def __iter__(self):
        return (self[k] for k in range(len(self)))


def shard(batches, rank: int, world: int):
    """Each rank's share; equal counts, so DDP ranks step in lockstep."""
    n = len(batches) // world * world
    return batches[rank:n:world]


def collate(src: list[list[int]], tgt: list[list[int]] | None, idx, pad_id: int, start_id: int,
            eos_id: int):
    """(src, tgt_in, tgt_out) padded LongTensors; src/tgt already end with eos."""
    s = [src[i] for i in idx]
    S = max(len(x) for x in s)
    src_t = torch.full((len(s), S), pad_id, dtype=torch.long)  # (B, S)
    for j, x in enumerate(s):
        src_t[j, :len(x)] = torch.tensor(x)
    if tgt is None:
        return src_t, None, None
    t = [tgt[i] for i in idx]
    T = max(len(x) for x in t)
    tgt_in = torch.full((len(t), T), pad_id, dtype=torch.long)   # (B, T): start + y[:-1]
    tgt_out = torch.full((len(t), T), pad_id, dtype=torch.long)  # (B, T): y (ends with eos)
    for j, x in enumerate(t):
        tgt_in[j, 0] = start_id
        tgt_in[j, 1:len(x)] = torch.tensor(x[:-1])
        tgt_out[j, :len(x)] = torch.tensor(x)
    return src_t, tgt_in, tgt_out
