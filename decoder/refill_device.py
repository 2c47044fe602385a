"""Finished greedy rows refilled on the device, step by step (switch refill_on_device).

decoder/refill.py (`host_segment`) refills a row once the host has read that it finished: the
host reads after each block of `sync_every` steps, while the next block runs,
so a row idles from its </s> to the block after next (8 to 16 steps at the
GPU's 8), and a longer block saves host reads at the cost of idle rows. Here
the host keeps a ring of encoded sentences on the device (`Ring`: their cross
K/V, key masks, caps and output slots), and at the end of every step the rows
that finished take the ring's next sentences, in fixed-shape ops a graph
captures with the step: a row idles no step while the ring holds sentences.
A sentence writes its tokens to an output slot of its own, not to its row's,
so its row is free the step after its </s>; once a block the host reads the
slots' finished flags and the ring's head (one read), sends the finished
slots' outputs on their way and tops the ring up.

A step moves at most `per_step` rows' cross K/V (the copy's shape is fixed:
the unused part goes to a spare row past the state's), and the ring holds
`ring` sentences: the host tops it up once a block, so a block's refills beyond
it wait for the next. The rows' computation is decoder/refill.py's, so the
tokens are greedy_static's (tests/test_refill_device.py).
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from .cache import DecoderState
from .refill import RefillCache, RefillGreedy, _on, _pending, _Todo, blocks
from .search import Search

# a state of N rows: at most N // PER_STEP_SHARE rows refilled a step (4,096 rows: 256, about twice
# the pace at which the Bible's sentences finish; a sixteenth of the rows of the test model's
# 64-row states gave the steps of an eighth or a half), a ring of N // RING_SHARE sentences: a
# ring of half the rows ran dry at blocks of 16 (the host tops it up a block after it reads)
PER_STEP_SHARE = 16
RING_SHARE = 1


class Ring:
    """Encoded sentences waiting on the device for rows, `size` of them at most: per decoder layer
    their cross (k, v) (G, S, d), key masks (G, 1, 1, S), caps (G,), output slots (G,); `head`
    (1,) the count the rows have taken, on the device; `filled` (1,) the count the host has put."""

    def __init__(self, cache: RefillCache, size: int):
        k0, dev = cache.cross_rows[0][0], cache.pos.device
        G, S, d = size, k0.shape[1], k0.shape[2]
        self.size, self.m = G, cache.m
        self.k_v = [(k0.new_zeros(G, S, d), k0.new_zeros(G, S, d)) for _ in cache.cross_rows]
        self.mask = torch.zeros(G, 1, 1, S, dtype=torch.bool, device=dev)
        self.limits = torch.ones(G, dtype=torch.long, device=dev)
        self.slot = torch.zeros(G, dtype=torch.long, device=dev)
        self.head = torch.zeros(1, dtype=torch.long, device=dev)
        self.filled = torch.zeros(1, dtype=torch.long, device=dev)
        self.put = 0  # the host's count of `filled`

    def free(self, taken: int) -> int:
        """Room for this many more, the rows having taken `taken` (as read, or more since)."""
        return self.size - (self.put - taken)

    def add(self, k_v: list, mask: torch.Tensor, limits: torch.Tensor, slots: torch.Tensor) -> None:
        """n sentences in after the last: per layer (k, v) (n, S', d), mask (n, 1, 1, S'), caps (n,),
        output slots (n,)."""
        n, S = limits.shape[0], mask.shape[-1]
        at = _on((self.put + np.arange(n)) % self.size, self.m)
        for (kb, vb), (k, v) in zip(self.k_v, k_v):
            kb[:, :S].index_copy_(0, at, k)
            vb[:, :S].index_copy_(0, at, v)
        self.mask.index_fill_(0, at, False)
        self.mask[:, :, :, :S].index_copy_(0, at, mask)
        self.limits.index_copy_(0, at, limits)
        self.slot.index_copy_(0, at, slots)
        self.put += n
        self.filled.fill_(self.put)


class DeviceRefillGreedy(RefillGreedy):
    """RefillGreedy whose finished rows take the ring's next sentences at the end of each step,
    and whose tokens go to each sentence's output slot: `out` (P + 1, T + 1), slot P the empty
    rows'; `finished` (P + 1,) each slot's sentence ended; `slot` (N,) each row's."""

    def __init__(self, state, s: Search, block: int, slots: int, ring: int, per_step: int):
        self.ring = Ring(state.cache, ring)
        self.per_step, self.P = per_step, slots
        super().__init__(state, s, block)
        N, dev = self.done.shape[0], self.done.device
        self.out = torch.full((slots + 1, self.out.shape[1]), self.pad, dtype=torch.long, device=dev)
        self.slot = torch.full((N,), slots, dtype=torch.long, device=dev)
        self.finished = torch.zeros(slots + 1, dtype=torch.bool, device=dev)
        self.ranks = torch.arange(per_step, device=dev)  # (M,)
        self.rows = torch.arange(N, device=dev)  # (N,)
        self.row = torch.empty(per_step + 1, dtype=torch.long, device=dev)  # (M + 1,) rank i's row, take()

    def record(self, nxt) -> None:
        col = torch.where(self.done, self.spare, self.cache.pos)  # (N,)
        self.out.view(-1).scatter_(0, self.slot * self.out.shape[1] + col, nxt)

    def advance(self) -> None:
        super().advance()
        self.finished.scatter_(0, self.slot, self.done)  # the empty rows' slot P: True, never read
        self.take()

    def take(self) -> None:
        """The finished rows, in row order, take the ring's next sentences, `per_step` at most;
        the others are left empty (slot P)."""
        c, r, N = self.cache, self.ring, self.done.shape[0]
        rank = torch.cumsum(self.done, 0) - 1  # (N,) a finished row's rank among them
        n = torch.clamp(torch.minimum(r.filled - r.head, self.done.sum()), max=self.per_step)  # (1,)
        takes = self.done & (rank < n)  # (N,)
        entry = (r.head + rank) % r.size  # (N,) meaningful where `takes`
        self.slot.copy_(torch.where(takes, r.slot[entry], torch.where(self.done, self.P, self.slot)))
        self.limits.copy_(torch.where(takes, r.limits[entry], self.limits))
        c.pos.masked_fill_(takes, 0)
        c.tokens.masked_fill_(takes, self.start)
        self.done &= ~takes
        # rank i's row, or the spare row N where fewer rows take: a copy of fixed shape (M,)
        row = self.row.fill_(N).scatter_(0, torch.where(takes, rank, self.per_step), self.rows)[:self.per_step]
        first = (r.head + self.ranks) % r.size  # (M,)
        for (kb, vb), (k, v) in zip(c.cross_rows, r.k_v):
            kb.index_copy_(0, row, k.index_select(0, first))
            vb.index_copy_(0, row, v.index_select(0, first))
        c.mask_rows.index_copy_(0, row, r.mask.index_select(0, first))
        r.head.add_(n)

    def place(self, rows, k_v, mask, limits, slots) -> None:
        """Rows `rows` start new sentences of output slots `slots` now (the first fill)."""
        self.slot[rows] = slots
        super().place(rows, k_v, mask, limits)

    def clear_outputs(self, rows) -> None:
        self.clear_slots(self.slot[rows])

    def clear_slots(self, slots) -> None:
        self.out.index_fill_(0, slots, self.pad)
        self.finished.index_fill_(0, slots, False)

    def flags(self) -> torch.Tensor:
        """(P + 1,) the slots' finished flags and the ring's head, one tensor for one read."""
        return torch.cat([self.finished[:self.P].long(), self.ring.head])


def device_segment(model, s: Search, encode, batches, srcs, rows: int, source: int, cap: int, phase,
                       more=None):
    """refill.host_segment's blocks with the rows refilled on the device: the same yields (the indices
    finished in a block, their Outputs) and return (the batches of `more` too long for the state)."""
    block = s.plan.sync_every
    ring, per_step = max(1, int(rows // RING_SHARE)), max(1, int(rows // PER_STEP_SHARE))
    P = rows + 2 * ring  # the rows' sentences, the ring's, those finished and not yet read
    cache = RefillCache(model, rows, source, -(-cap // block) * block, spare=1)
    loop = DeviceRefillGreedy(DecoderState(model, cache, None, phase), s, block, P, ring, per_step)
    todo, queue = _Todo(batches, more, source, srcs), deque()
    owner = np.full(P, -1)  # (P,) the sentence of each output slot, -1: none
    ready = np.zeros(P, dtype=np.int64)  # (P,) the first block whose finished flag is owner's
    taken = 0  # sentences the ring has handed to rows, as of the latest read

    def finished(read: np.ndarray) -> np.ndarray:
        nonlocal taken
        taken = max(taken, int(read[-1]))
        return read[:-1].astype(bool)

    _fill(loop, encode, srcs, model, todo, queue, owner, ready, 0, rows, into_rows=True)
    _fill(loop, encode, srcs, model, todo, queue, owner, ready, 0, ring)
    yield from blocks(loop, s, phase, owner, ready, model, finished, lambda loop, issued: _fill(
        loop, encode, srcs, model, todo, queue, owner, ready, issued, loop.ring.free(taken)))
    return todo.later


def _fill(loop, encode, srcs, model, todo, queue, owner, ready, first: int, room: int, into_rows=False) -> None:
    """Up to `room` waiting sentences into free output slots, their flags read from block `first`
    on: the first fill straight into rows, the others into the ring; a batch is encoded ahead
    as in refill._refill."""
    free = np.flatnonzero(owner < 0)
    todo.fill(wait=free.size == owner.size and not todo and not queue)  # the GPU idle otherwise
    free = free[:room]
    while free.size and (queue or todo):
        if not queue:
            queue.append(_pending(encode, srcs, todo.popleft(), model))
        p = queue[0]
        n = min(free.size, len(p.ids) - p.next)
        take, slots = _on(np.arange(p.next, p.next + n), model), _on(free[:n], model)
        k_v = [(k.index_select(0, take), v.index_select(0, take)) for k, v in p.k_v]
        mask, limits = p.mask.index_select(0, take), p.limits.index_select(0, take)
        if into_rows:
            loop.place(_on(np.arange(n) + int((owner >= 0).sum()), model), k_v, mask, limits, slots)
        else:
            loop.clear_slots(slots)
            loop.ring.add(k_v, mask, limits, slots)
        owner[free[:n]] = p.ids[p.next:p.next + n]
        ready[free[:n]] = first
        free, p.next = free[n:], p.next + n
        if p.next == len(p.ids):
            queue.popleft()
    if todo and sum(len(p.ids) - p.next for p in queue) < loop.ring.size:
        queue.append(_pending(encode, srcs, todo.popleft(), model))
