"""Greedy decoding with finished rows refilled (switch refill_rows): continuous batching.

A fixed-shape batch (decoder/static_steps.py `greedy_static`) decodes until its
longest output ends, its finished rows fed <pad> meanwhile. On the Bible's
first 10,000 training lines at the GPU's 64k-token batches that is half of
the rows' steps, and the batches' few rows (682-2,427: the budget counts source
tokens) make each step a few latency-bound kernels: 504 steps in all, each one
slower than its arithmetic. Here a chunk's sentences stream through one
fixed-shape state of many rows (`rows_for`): each row has its own position,
and after every `block` steps the host reads which rows have finished (while
the next block runs), sends their outputs on their way (hostsync.later) and
puts the next sentences, encoded ahead in the usual length-sorted batches,
into their rows. One graph serves the whole chunk: no capture per batch, and
the steps are as many as the chunk's tokens need at the state's width, or its
longest output's, which starts first.

A row's computation is the same as in a batch of its own (its position, its
source, its cache), so the tokens are greedy_static's (tests/test_refill.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from . import hostsync
from .cache import DecoderState, StaticCache
from .fused import heads
from .search import Outputs, Search
from .static_steps import StaticGreedy, narrow_to

# The state's rows: max_tokens // ROW_TOKENS (4,096 at the GPU's 64k), at most max_sentences.
# Its positions (rows x (source + target cap)) at most POSITION_BUDGET x max_tokens: K/V of
# 16 x 64k positions are 2 GB a decoder layer at d 512 in fp16.
ROW_TOKENS = 16
POSITION_BUDGET = 16
# chunks of at most this many sentences, or states of at most this many rows (batch 1, the
# latency mode), keep the per-batch loop and graph_reuse's kept states
MIN_SENTENCES = 16


def applies(sentences: int, max_tokens: int, max_sentences: int) -> bool:
    """Whether a chunk of this many sentences is refilled at these batch settings."""
    return sentences > MIN_SENTENCES and min(max_sentences, max_tokens // ROW_TOKENS) > MIN_SENTENCES


def rows_for(max_tokens: int, max_sentences: int, source: int, cap: int) -> int:
    """Rows of a state whose longest source has `source` tokens and longest output `cap`."""
    return max(1, min(max_sentences, max_tokens // ROW_TOKENS, POSITION_BUDGET * max_tokens // (source + cap)))


def segments(batches: list[list[int]], lengths: list[int], caps: list[int], max_tokens: int,
             max_sentences: int) -> list[tuple[int, int]]:
    """(first, end) runs of `batches` (length-sorted, longest first) that share one state: a
    new one starts where the rows allowed at least double (a chunk's few long lines would
    otherwise hold every later sentence to their narrow state)."""
    out, first, rows = [], 0, None
    for i, b in enumerate(batches):
        n = rows_for(max_tokens, max_sentences, max(lengths[j] for j in b), max(caps[j] for j in b))
        if rows is not None and n >= 2 * rows:
            out.append((first, i))
            first = i
        if rows is None or first == i:
            rows = n
    if batches:
        out.append((first, len(batches)))
    return out


class RefillCache(StaticCache):
    """StaticCache with a position per row and rows that take new sentences (`place`):
    the position embedding, the K/V write and the mask past the position are each row's."""

    def __init__(self, model, rows: int, source: int, max_len: int, spare: int = 0):
        d, dev = model.d, model.emb.device
        enc = torch.zeros(rows + spare, source, d, dtype=model.dtype, device=dev)  # (N + spare, S, d) no sentence yet
        mask = torch.zeros(rows + spare, 1, 1, source, dtype=torch.bool, device=dev)  # (N + spare, 1, 1, S)
        mask[..., 0] = True  # an empty row attends to one (zero) key: finite, never used
        super().__init__(model, enc[:rows], mask[:rows], 1, max_len, graphs=model.plan.cuda_graphs)
        # the cross K/V as buffers of their own, (N + spare, S, d) each, written row by row by `place`;
        # `spare` rows past the state's take the writes a fixed-shape copy makes for no row
        self.cross_rows = [(torch.zeros_like(enc), torch.zeros_like(enc)) for _ in model.dec_layers]
        self.cross = [(heads(k[:rows], model.n_heads), heads(v[:rows], model.n_heads)) for k, v in self.cross_rows]
        self.mask_rows = mask
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)  # (N,) each row's position
        self.position_mask = _row_attend_mask if self.plan.static_attend else _row_bias_mask
        h, hd = self.kv.shape[3], self.kv.shape[-1]
        self.write_at = self.pos.view(rows, 1, 1, 1).expand(rows, h, 1, hd)  # (N, h, 1, hd) a view of pos

    def write(self, cache, x) -> None:
        cache.scatter_(2, self.write_at, x)  # each row at its own position

    def place(self, slots: torch.Tensor, k_v: list, mask: torch.Tensor) -> None:
        """Rows `slots` (n,) take new sentences: per decoder layer their cross (k, v) (n, S', d),
        their key mask (n, 1, 1, S'); position 0 (the searches' loop resets the rest)."""
        S = mask.shape[-1]
        for (kb, vb), (k, v) in zip(self.cross_rows, k_v):
            kb[slots, :S] = k
            vb[slots, :S] = v
        self.mask[slots] = False
        self.mask[slots, :, :, :S] = mask
        self.pos[slots] = 0


def _row_bias_mask(positions, pos, x):
    """(N, 1, 1, T) for SDPA: 0 up to each row's position, -inf after it."""
    past = positions[None, :] > pos[:, None]  # (N, T)
    return torch.zeros(past.shape, dtype=x.dtype, device=x.device).masked_fill_(past, float("-inf"))[:, None, None]


def _row_attend_mask(positions, pos, x):
    """(N, 1, 1, T) for the decode-step attention kernel: True up to each row's position."""
    return (positions[None, :] <= pos[:, None])[:, None, None]


class RefillGreedy(StaticGreedy):
    """StaticGreedy's block of whole steps with a position per row: a finished row's position
    stops, and its <pad> goes to the last column of `out`, past every cap, which no read uses."""

    def __init__(self, state, s: Search, block: int):
        N = state.cache.pos.shape[0]
        super().__init__(state, torch.ones(N, dtype=torch.long, device=state.cache.pos.device), s, block)
        self.out = torch.full((N, self.out.shape[1] + 1), self.pad, dtype=torch.long, device=self.out.device)
        self.spare = self.out.shape[1] - 1
        self.done.fill_(True)  # every row empty until `place`

    def record(self, nxt) -> None:
        self.out.scatter_(1, torch.where(self.done, self.spare, self.cache.pos)[:, None], nxt[:, None])

    def advance(self) -> None:
        self.cache.pos.add_(self.done.logical_not())  # a finished row's position stops

    def flags(self) -> torch.Tensor:
        """(N,) what the host reads after a block: each row's finished flag."""
        return self.done

    def place(self, slots: torch.Tensor, k_v: list, mask: torch.Tensor, limits: torch.Tensor) -> None:
        """Rows `slots` start new sentences (RefillCache.place) of these caps (n,)."""
        self.cache.place(slots, k_v, mask)
        self.limits[slots] = limits
        self.cache.tokens[slots] = self.start
        self.done[slots] = False
        self.clear_outputs(slots)

    def clear_outputs(self, rows: torch.Tensor) -> None:
        """The outputs of the sentences just placed in `rows`, <pad> before their first token."""
        self.out[rows] = self.pad

    def take_rows(self, old: "RefillGreedy", rows: torch.Tensor) -> None:
        """This state's first rows take over `old`'s rows `rows` (n,) mid-sentence: their K/V so far
        (the whole buffer: a host read of the positions would wait for the GPU), cross K/V and key
        masks, positions, next tokens, caps, finished flags and outputs so far; the rest stay empty."""
        n, c, o = rows.shape[0], self.cache, old.cache
        c.kv[:, :, :n] = o.kv.index_select(2, rows)
        for (kb, vb), (ok, ov) in zip(c.cross_rows, o.cross_rows):
            kb[:n] = ok.index_select(0, rows)
            vb[:n] = ov.index_select(0, rows)
        c.mask_rows[:n] = o.mask_rows.index_select(0, rows)
        for new, was in ((c.pos, o.pos), (c.tokens, o.tokens), (self.limits, old.limits), (self.done, old.done),
                         (self.out, old.out)):
            new[:n] = was.index_select(0, rows)


@dataclass
class Pending:
    """An encoded batch whose sentences wait for rows: their ids in the chunk, the batch's
    cross K/V per decoder layer (B, S, d), key mask (B, 1, 1, S), caps (B,); `next` the first
    not yet placed."""
    ids: list[int]
    k_v: list
    mask: torch.Tensor
    limits: torch.Tensor
    next: int = 0


def refilled(model, s: Search, encode: Callable, batches: list[list[int]], srcs: list, caps: list[int],
             max_tokens: int, max_sentences: int, phase, more: "More | None" = None,
             segment: Callable | None = None) -> Iterator[tuple[list[int], Outputs]]:
    """Greedy outputs of the sentences `srcs` (source ids with </s>) in `batches` (index lists,
    length-sorted, longest first): (the indices finished in a block, their Outputs), block by block.
    `encode(list of source ids)` -> decoder/translator.py Encoded; `caps` each sentence's cap.
    `more`: the chunk's other sentences, still being encoded (switch early_start): they join the
    last state where their sources fit it, and the others follow in states of their own.
    `segment`: what runs a state's blocks, `host_segment` (None) or decoder/refill_device.py's."""
    segment = segment or host_segment
    lengths = [0 if x is None else len(x) for x in srcs]
    parts = segments(batches, lengths, caps, max_tokens, max_sentences)
    for k, (first, end) in enumerate(parts):
        part = batches[first:end]
        every = [j for b in part for j in b]  # the longest first where sorted; any order works
        source, cap = max(lengths[j] for j in every), max(caps[j] for j in every)
        rest = more if k == len(parts) - 1 else None  # the widest state takes them
        rows = rows_for(max_tokens, max_sentences, source, cap)
        later = yield from segment(model, s, encode, part, srcs, rows if rest else min(rows, len(every)), source,
                                   cap, phase, rest)
        if later:
            yield from refilled(model, s, encode, later, srcs, caps, max_tokens, max_sentences, phase, None, segment)


class More:
    """Sentences of the chunk still being encoded: `ready()` without waiting; `take()` waits,
    fills the chunk's srcs and caps in, and gives their batches (length-sorted index lists)."""

    def __init__(self, ready: Callable[[], bool], take: Callable[[], list]):
        self.ready, self.take = ready, take


def host_segment(model, s, encode, batches, srcs, rows, source, cap, phase, more=None):
    """One state's blocks. The host reads block i's finished rows while block i+1 runs, so the
    GPU always has a block queued: rows refilled after that read run from block i+2 on, and
    their finished flag counts from there (`ready`); until then it is their last sentence's.
    With narrow_tail, once no sentence waits, the busy rows move to narrower states (`narrow_to`).
    Returns the batches of `more` whose sources are longer than the state's."""
    block = s.plan.sync_every
    T = -(-cap // block) * block

    def state(n: int) -> RefillGreedy:
        return RefillGreedy(DecoderState(model, RefillCache(model, n, source, T), None, phase), s, block)
    loop = state(rows)
    todo, queue = _Todo(batches, more, source, srcs), deque()
    owner = np.full(rows, -1)  # (N,) the sentence in each row, -1: none
    ready = np.zeros(rows, dtype=np.int64)  # (N,) the first block whose finished flag is owner's
    _refill(loop, encode, srcs, model, todo, queue, owner, ready, 0)

    def narrow(loop, owner: np.ndarray):
        if todo or queue or todo.more is not None:
            return None
        busy = np.flatnonzero(owner >= 0)  # (n,)
        n = narrow_to(owner.size, busy.size)
        if n == owner.size:
            return None
        with phase("batch shrink"):
            narrower = state(n)
            narrower.take_rows(loop, _on(busy, model))
        return narrower, busy

    run = blocks(loop, s, phase, owner, ready, model, lambda flags: flags,
                 lambda loop, issued: _refill(loop, encode, srcs, model, todo, queue, owner, ready, issued),
                 narrow if s.plan.narrow_tail else None)
    del loop  # a narrower state frees this one
    yield from run
    return todo.later


def blocks(loop, s: Search, phase, owner: np.ndarray, ready: np.ndarray, model,
           finished: Callable[[np.ndarray], np.ndarray], refill: Callable[..., None],
           narrow: Callable | None = None) -> Iterator:
    """A refilled state's blocks, two in flight, until no row or output slot is busy: after each
    read, the slots `finished(read)` says ended, whose flag is their sentence's (`ready`), leave
    (the sentences' indices and their Outputs), then `refill(loop, blocks issued)` fills free ones.
    `narrow(loop, owner)`: None, or a narrower loop that took over this one's busy rows and their
    indices here (n,), behind the block in flight; that block's read is then mapped onto the new
    rows, and nothing is refilled from then on (it narrows only once no sentence waits)."""
    # (block, its read, the loop it ran on: held until the read, as the GPU may still run its graph,
    # the read's row of each row here, None: the same)
    snaps, issued, first = deque(), 0, 0
    while True:
        while len(snaps) < 2 and (owner >= 0).any():
            snaps.append((*issue(loop, s, phase, issued, issued == first), loop, None))
            issued += 1
        if not snaps:
            return
        i, read, _, rows = snaps.popleft()
        flags = finished(read.array())
        fin = np.flatnonzero((flags if rows is None else flags[rows]) & (owner >= 0) & (ready <= i))
        if fin.size:
            out = hostsync.later(loop.out.index_select(0, _on(fin, model)), "outputs")
            yield owner[fin].tolist(), Outputs(lambda out=out: out.until(s.eos_id))
            owner[fin] = -1
        if refill is not None:
            refill(loop, issued)
        moved = narrow(loop, owner) if narrow is not None else None
        if moved is not None:
            loop, kept = moved
            n = loop.done.shape[0]
            owner, ready = _padded(owner[kept], n, -1), _padded(ready[kept], n, 0)
            snaps = deque((j, r, ran, _padded(kept if m is None else m[kept], n, 0)) for j, r, ran, m in snaps)
            first, refill = issued, None


def _padded(a: np.ndarray, n: int, fill: int) -> np.ndarray:
    """(n,) a, then `fill`."""
    return np.concatenate([a, np.full(n - a.size, fill, dtype=a.dtype)])


def issue(loop, s: Search, phase, i: int, first: bool) -> tuple:
    """Block i queued (the graph captured ahead behind the loop's `first` block) -> (i, its
    finished flags on their way to the host)."""
    with phase("decode steps"):
        loop.run(0)
        if first and s.plan.capture_ahead:
            loop.capture_ahead()
    return i, hostsync.later(loop.flags(), "finished?")


class _Todo(deque):
    """The batches waiting for rows, and `more` taken in once ready, or waited for once no row
    is busy and nothing else waits: those whose sources fit the state (`source` tokens) at the
    end, the others kept in `later` for a state of their own."""

    def __init__(self, batches, more: More | None, source: int, srcs: list):
        super().__init__(batches)
        self.more, self.source, self.srcs, self.later = more, source, srcs, []

    def fill(self, wait: bool) -> None:
        if self.more is not None and (wait or self.more.ready()):
            for b in self.more.take():
                (self if max(len(self.srcs[j]) for j in b) <= self.source else self.later).append(b)
            self.more = None


def _refill(loop, encode, srcs, model, todo: _Todo, queue, owner, ready, first: int) -> None:
    """The free rows take the next waiting sentences, from block `first` on; a batch is encoded
    whenever fewer than a state's worth of sentences wait, so the next one's encoder is queued
    behind the blocks in flight."""
    free = np.flatnonzero(owner < 0)
    todo.fill(wait=free.size == owner.size and not todo and not queue)  # the GPU idle otherwise
    while free.size and (queue or todo):
        if not queue:
            queue.append(_pending(encode, srcs, todo.popleft(), model))
        p = queue[0]
        n = min(free.size, len(p.ids) - p.next)
        take = _on(np.arange(p.next, p.next + n), model)
        loop.place(_on(free[:n], model), [(k.index_select(0, take), v.index_select(0, take)) for k, v in p.k_v],
                   p.mask.index_select(0, take), p.limits.index_select(0, take))
        owner[free[:n]] = p.ids[p.next:p.next + n]
        ready[free[:n]] = first
        free, p.next = free[n:], p.next + n
        if p.next == len(p.ids):
            queue.popleft()
    if todo and sum(len(p.ids) - p.next for p in queue) < owner.size:
        queue.append(_pending(encode, srcs, todo.popleft(), model))


def _pending(encode, srcs, batch: list[int], model) -> Pending:
    e = encode([srcs[j] for j in batch])
    return Pending(batch, [L.cross.project_kv(e.enc) for L in model.dec_layers], e.mask, e.limits)


def _on(a: np.ndarray, model) -> torch.Tensor:
    return hostsync.to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), model.emb.device)
