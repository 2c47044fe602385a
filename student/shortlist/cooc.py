"""Sentence co-occurrence counts of a parallel corpus, streamed through disk.

The counts c(s, t) (sentence pairs with source id s and target id t) form a
(V, V) matrix, too big to hold at once for a real vocabulary (32k x 32k int32
is 4 GB), over a corpus too big to hold at all. So two passes:

1. A chunk of pairs at a time (count_chunk; over the cores when the corpus is a
   large file): each sentence's distinct ids, the target ones in sentence order,
   the source ones grouped by row block (`rows` source ids), written to a temp
   dir; the per-id totals (document frequencies, target occurrences) summed.
2. A row block at a time (block_counts): every chunk's source entries in the
   block meet the targets of their sentence in a dense (rows, V) int32 block.

Memory: one chunk, one block and the temporaries of MAX_PAIRS pairs, whatever
the corpus' size; disk: about 6 bytes a distinct token of the corpus.
"""
from __future__ import annotations

import itertools
import os
from typing import Iterable, NamedTuple

import numpy as np
import torch

MAX_PAIRS = 1 << 24  # (source, target) pairs per index_add_: ~400 MB of temporaries


class Plan(NamedTuple):
    """How chunks are counted (picklable: it travels with each worker's task)."""
    vocab: int
    rows: int            # source ids a block of the second pass
    exclude: np.ndarray  # (E,) int64: ids never counted (<s>, <pad>, </s>, <unk>)
    out: str             # the chunk files' dir

    @property
    def n_blocks(self) -> int:
        return -(-self.vocab // self.rows)


def plan(vocab: int, exclude, block_mb: int, out: str) -> Plan:
    """Blocks of block_mb MiB of int32 counts (3 x block_mb with the block's Dice and top-k)."""
    rows = max(1, min(vocab, block_mb * 2 ** 20 // (4 * vocab)))
    return Plan(vocab, rows, np.array(sorted(set(exclude)), dtype=np.int64), out)


def flat(seqs) -> tuple[np.ndarray, np.ndarray]:
    """(lengths (n,), ids end to end (sum of lengths,)) of token-id lists, int64."""
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    return lens, ids


def _distinct(lens: np.ndarray, ids: np.ndarray, p: Plan) -> tuple[np.ndarray, np.ndarray]:
    """The distinct counted ids of each sentence, by sentence then id: (sentence (m,), id (m,)).
    Co-occurrence counts sentences, not tokens."""
    sent = np.repeat(np.arange(len(lens)), lens)  # (n,)
    keep = ~np.isin(ids, p.exclude)
    key = np.unique(sent[keep] * p.vocab + ids[keep])  # (m,) sorted
    return key // p.vocab, key % p.vocab


def _small(limit: int):
    return np.uint16 if limit <= 1 << 16 else np.int32


def count_chunk(i: int, src, tgt, p: Plan) -> np.ndarray:
    """Chunk i's files from its sentences, each side (lengths (n,), ids end to end); returns
    (3, V) int64: sentences holding each source id, each target id, and target occurrences."""
    V, n = p.vocab, len(src[0])
    for name, (_, ids) in (("source", src), ("target", tgt)):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"{name} token ids outside [0, {V})")
    s_sent, s_tok = _distinct(*src, p)
    t_sent, t_tok = _distinct(*tgt, p)
    block = s_tok // p.rows
    order = np.argsort(block, kind="stable")  # by block, and within one by sentence as before
    arrays = {"ssent": s_sent[order].astype(_small(n)), "stok": s_tok[order].astype(_small(V)),
              "bounds": np.searchsorted(block[order], np.arange(p.n_blocks + 1)),
              "ttok": t_tok.astype(_small(V)), "tlen": np.bincount(t_sent, minlength=n).astype(np.int32)}
    for kind, a in arrays.items():
        np.save(_name(p.out, kind, i), a)
    return np.stack([np.bincount(s_tok, minlength=V), np.bincount(t_tok, minlength=V),
                     np.bincount(tgt[1], minlength=V)]).astype(np.int64)


def count_ids(task) -> np.ndarray:
    """count_chunk of a task (i, (source, target) token-id lists, plan)."""
    i, (src, tgt), p = task
    return count_chunk(i, flat(src), flat(tgt), p)


def totals(stats: Iterable[np.ndarray], vocab: int) -> tuple[int, np.ndarray]:
    """(chunks, (3, V) summed totals) of the first pass' results."""
    n, total = 0, np.zeros((3, vocab), dtype=np.int64)
    for s in stats:
        n, total = n + 1, total + s
    return n, total


def block_counts(b: int, n_chunks: int, p: Plan) -> torch.Tensor:
    """(R, V) int32: c(s, t) for the source ids s of block b (lo = b * rows, R of them) and every t."""
    lo, V = b * p.rows, p.vocab
    rows = min(V, lo + p.rows) - lo
    counts = torch.zeros(rows * V, dtype=torch.int32)
    for i in range(n_chunks):
        a, z = np.load(_name(p.out, "bounds", i))[b:b + 2]
        if a == z:
            continue
        # the slices are copied and the maps dropped, so the resident pages stay one chunk's
        bs, bt = (torch.from_numpy(np.load(_name(p.out, k, i), mmap_mode="r")[a:z].astype(np.int64))
                  for k in ("ssent", "stok"))
        t_len = torch.from_numpy(np.load(_name(p.out, "tlen", i)).astype(np.int64))  # (n,)
        _add(counts, bs, bt - lo, t_len, np.load(_name(p.out, "ttok", i)), V)
    return counts.view(rows, V)


def _add(counts: torch.Tensor, bs, bt, t_len, t_tok: np.ndarray, V: int) -> None:
    """counts[row * V + t] += 1 for each source entry (sentence bs, row bt) and each target t
    of its sentence."""
    t_off = torch.cumsum(t_len, 0) - t_len  # (n,) where a sentence's targets start in t_tok
    reps = t_len[bs]  # (mb,) each entry pairs with all its sentence's targets
    for a, b in _ranges(reps, MAX_PAIRS):
        r = reps[a:b]
        first = torch.cumsum(r, 0) - r
        pos = torch.repeat_interleave(t_off[bs[a:b]] - first, r) + torch.arange(int(r.sum()))  # (p,)
        key = torch.repeat_interleave(bt[a:b], r) * V + torch.from_numpy(t_tok[pos.numpy()].astype(np.int64))
        counts.index_add_(0, key, torch.ones(key.numel(), dtype=torch.int32))


def _ranges(reps: torch.Tensor, max_pairs: int):
    """(a, b) ranges of source entries whose target repeats sum to about max_pairs."""
    c = torch.cumsum(reps, 0)
    a = 0
    while a < reps.numel():
        base = int(c[a - 1]) if a else 0
        b = max(a + 1, int(torch.searchsorted(c, base + max_pairs, right=True)))
        yield a, b
        a = b


def _name(out: str, kind: str, i: int) -> str:
    return os.path.join(out, f"{kind}-{i:05d}.npy")
