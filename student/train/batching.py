"""Length-grouped token-budget batches, reproducible from (seed, epoch) alone.

Resume needs no saved batch list: the batches of an epoch are a pure function
of the seed and the epoch number, so the data position is (epoch, index).
"""
from __future__ import annotations

import numpy as np
import torch

from decoder.batching import pack


def make_batches(src_lens, tgt_lens, max_tokens: int, max_sentences: int, seed: int, epoch: int,
                 shuffle: bool = True) -> list[np.ndarray]:
    """Index arrays; each batch's padded size max(len) * n stays under max_tokens."""
    rng = np.random.default_rng([seed, epoch])
    lens = np.maximum(np.asarray(src_lens), np.asarray(tgt_lens))
    # ascending lengths, random tie-break so equal-length sentences mix differently each epoch
    order = np.lexsort((rng.random(len(lens)) if shuffle else np.arange(len(lens)), lens))
    batches = [np.asarray(b, dtype=np.int64) for b in pack(order.tolist(), lens.tolist(), max_tokens, max_sentences)]
    if shuffle:
        perm = rng.permutation(len(batches))
        batches = [batches[i] for i in perm]
    return batches


def shard(batches: list, rank: int, world: int) -> list:
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
