"""The searches' steps at fixed addresses, replayed as CUDA graphs (switch graph_steps).

On the fixed-shape state (decoder/cache.py StaticCache) a captured graph holds
the decoder's step; around it the searches' own bookkeeping (projection, argmax
or top-k, forced </s>, finished rows, the histories, the beam reorder) cost the
host about 14 launches a greedy step and 35 a beam step, each a few
microseconds of Python and CUDA launch while the GPU's step at batch 1 is
shorter than that. Here that bookkeeping works on tensors that live with the
state, so it is captured with the step:

- `StaticGreedy`: `block` (= plan.sync_every) whole greedy steps one graph, the
  position advanced on the device; the host replays a block, then reads whether
  every row has finished.
- `StaticBeam`: one whole beam step a graph, two graphs: before any sentence's
  limit the plan's top-k (the fused kernel), from the first limit on the plain
  top-k with </s> forced where a sentence is at its limit, as `beam_device`
  does. The host reads the finished sentences every `sync_every` steps.

The picks are `greedy_device`'s and `beam_device`'s (tests/test_graphs.py). A
loop is kept with its state (cache.loops), so a state kept for a batch shape
(switch graph_reuse) replays its graphs for the next batch of that shape. On CPU
(static_shapes, the tests) the same ops run eagerly.
"""
from __future__ import annotations

import numpy as np
import torch

from . import graphs, hostsync
from .search import NEG_INF, Finals, Outputs, Search, beam_top, checkpoint, pick


def kept(state, kind: str, make, limits):
    """The state's loop of this kind: one kept with it, reset for this batch's limits, else a new one,
    kept with it where the state is kept for later batches (graph_reuse; a loop and its state refer
    to each other, so a batch's own would outlive the batch until the collector's next full pass)."""
    loop = state.cache.loops.get(kind)
    if loop is None:
        loop = make()
        if state.cache.kept:
            state.cache.loops[kind] = loop
    else:
        loop.reset(limits)
    return loop


def greedy_static(state, limits, s: Search, lims: list[int]) -> Outputs:
    """`greedy_device`'s picks, `plan.sync_every` whole steps a replay, one read after each."""
    T, block = max(lims), s.plan.sync_every
    loop = kept(state, "greedy", lambda: StaticGreedy(state, limits, s, block), limits)
    for t in range(0, T, block):
        with state.phase("decode steps"):
            loop.run(t)
            if t == 0 and T > block and s.plan.capture_ahead:
                loop.capture_ahead()
        if hostsync.item(loop.done.all(), "finished?"):
            break
    rows, eos_id = hostsync.later(loop.out[:, :t + block], "outputs"), s.eos_id
    return Outputs(lambda: rows.until(eos_id))


def beam_static(state, limits, s: Search, lims: list[int]) -> Outputs:
    """`beam_device`'s picks, one whole step a replay, a read every `plan.sync_every` steps (which
    sentences have finished); with narrow_beam the unfinished ones move to a narrower state."""
    T, every = max(lims), s.plan.sync_every
    first_limit = min(lims) - 1  # from this step on some sentence is at its limit: </s> forced there
    loop = kept(state, "beam", lambda: StaticBeam(state, limits, s), limits)
    finals = loop.finals  # the batch's, whichever state runs its sentences
    for t in range(T):
        with state.phase("decode steps"):
            loop.run(t, forced=t >= first_limit)
        if checkpoint(t, T, every):
            done = hostsync.to_cpu(loop.done(t), "finished?").numpy()  # (sentences,)
            if done.all():
                break
            rows, busy = done.size * loop.K, int((~done).sum()) * loop.K
            if s.plan.narrow_beam and narrow_to(rows, busy) < rows:  # to exactly the busy rows
                with state.phase("batch shrink"):
                    loop = loop.narrowed(np.flatnonzero(~done), t + 1)
    return finals.best(s.length_penalty, t + 1)


# switches narrow_tail and narrow_beam: a state moves its busy rows to a narrower one only where half
# of it is at least this many rows. A step's kernels are linear in the rows at thousands (the H200's
# attention: 0.46 ms a call at 4,096 rows, 0.91 at 8,192), hardly below some hundreds (an estimate),
# where a narrower state's eager step and captures would cost more than its steps save.
NARROW_MIN = 256


def narrow_to(rows: int, busy: int) -> int:
    """The rows of the state that a state of `rows` rows, `busy` of them busy, moves to: halved while
    half still holds the busy rows, not below NARROW_MIN; `rows` where it stays (narrow_tail: a
    refilled state once no sentence waits; narrow_beam moves where this narrows, to exactly its busy rows)."""
    while busy and rows // 2 >= max(busy, NARROW_MIN):
        rows //= 2
    return rows


class StaticLoop:
    """What both loops hold: the state's cache, the search's ids, a copy of the batch's limits
    (sentences,); `reset` takes them back to step 0 for a new batch of this shape."""

    def __init__(self, state, limits, s: Search):
        self.state, self.s, self.cache = state, s, state.cache
        self.start, self.eos, self.pad = s.start_id, s.eos_id, s.pad_id
        self.limits = limits.clone()

    def reset(self, limits=None) -> None:
        if limits is not None:
            self.limits.copy_(limits)
        self.cache.tokens.fill_(self.start)
        self.cache.pos.zero_()
        self.clear()


class StaticGreedy(StaticLoop):
    """Greedy's whole step on a StaticCache, every tensor at a fixed address, `block` steps a
    run: the decoder's step, the projection and argmax, </s> forced at each row's limit, <pad>
    fed to finished rows, the token written to `out`, the position advanced."""

    def __init__(self, state, limits, s: Search, block: int):
        super().__init__(state, limits, s)
        m, p, out = state.m, state.m.plan, state.out
        self.head = (lambda y: m.project_argmax(y, out)) if p.argmax_in_step else \
            (lambda y: p.argmax(p.normalise(m.project(y, out))))  # y (N, d) -> argmax columns (N,)
        self.block = block
        N, T = self.cache.tokens.shape[0], self.cache.positions.shape[0]
        self.done = torch.zeros(N, dtype=torch.bool, device=limits.device)  # (N,)
        self.out = torch.empty(N, T, dtype=torch.long, device=limits.device)  # (N, T) tokens by position
        self.steps = graphs.Captured(self._steps, state.m)
        self.reset()

    def clear(self) -> None:
        self.done.zero_()
        self.out.fill_(self.pad)

    def _steps(self):
        c = self.cache
        for _ in range(self.block):
            nxt = self.head(c._run())  # (N,)
            nxt = torch.where(self.limits <= c.pos + 1, self.eos, nxt)
            nxt = torch.where(self.done, self.pad, nxt)
            self.record(nxt)
            self.done |= nxt == self.eos
            c.tokens.copy_(nxt)
            self.advance()
        return self.done

    def record(self, nxt) -> None:
        """The step's tokens (N,) into `out` at the position."""
        self.out.index_copy_(1, self.cache.pos, nxt[:, None])

    def advance(self) -> None:
        self.cache.pos.add_(1)

    def capture_ahead(self) -> None:
        """The block's graph captured now, behind the warm-up block the GPU is running, where
        the next block would capture it only after the host's read had waited for that."""
        if self.cache.use_graph:
            self.steps.ahead()

    def run(self, t: int) -> None:
        """Steps t .. t+block-1 (the position itself advances on the device)."""
        if self.cache.use_graph:
            self.steps()
        else:
            self._steps()


class StaticBeam(StaticLoop):
    """`beam_device`'s step on a StaticCache, every tensor at a fixed address: the decoder's
    step, the top 2K, the finished hypotheses kept (`Finals`), the best K continuations, the
    histories (N, T) and the K/V cache reordered, the position advanced."""

    def __init__(self, state, limits, s: Search, finals: Finals | None = None, sent=None):
        """`finals` and `sent` (B,): a narrowed loop's, the batch's finished hypotheses and the
        index there of each of its sentences (StaticBeam.narrowed); else this batch's own."""
        super().__init__(state, limits, s)
        m, out, K = state.m, state.out, s.beam
        self.plan, self.K = m.plan, K
        self.project = lambda y: m.project(y, out)  # (N, d) -> logits (N, V)
        B, T, V, dev = limits.shape[0], self.cache.positions.shape[0], state.columns, limits.device
        self.n_top = min(2 * K, K * V)
        self.scores = torch.empty(B, K, device=dev)  # (sentences, beam) summed log-probs
        self.hist = torch.empty(B * K, T, dtype=torch.long, device=dev)  # (rows, T) tokens by position
        self.finals = Finals(B, K, T, s.pad_id, dev) if finals is None else finals
        self.first = torch.arange(B, device=dev)[:, None] * K  # (B, 1) each sentence's first row
        self.sent = torch.arange(B, device=dev) if sent is None else sent  # (B,) its slots in `finals`
        self.rank = torch.arange(self.n_top, device=dev)  # (n_top,) </s> ranked after the rest:
        self.rank_eos = self.rank + self.n_top              # its ranks shifted by n_top
        self.steps = {f: graphs.Captured(self._step, m, f) for f in (False, True)}
        if finals is None:
            self.reset()

    def clear(self) -> None:
        self.scores.zero_()
        self.scores[:, 1:] = NEG_INF  # all beams start equal: keep one
        self.hist.fill_(self.pad)
        f = self.finals
        f.score.fill_(NEG_INF)
        f.tokens.fill_(self.pad)
        f.count.zero_()

    def _step(self, forced: bool):
        c, K = self.cache, self.K
        logits = self.project(c._run())  # (N, V)
        V = logits.shape[-1]
        top_s, top_i = beam_top(self.plan, logits, self.scores, self.limits, K, self.n_top, c.pos,
                                self.eos if forced else None)  # (B, n_top)
        src_beam, col = top_i // V, top_i % V
        is_eos = col == self.eos
        # a sentence past its limit (limits <= t) was done before this step: it keeps nothing
        ends = is_eos[:, :K] & (top_s[:, :K] > NEG_INF) & (self.limits > c.pos)[:, None]
        self.finals.add(c.pos, self.sent, ends, top_s, self.hist, (self.first + src_beam[:, :K]).view(-1))
        scores, rows, tokens = pick(top_s, col, src_beam, torch.where(is_eos, self.rank_eos, self.rank),
                                    self.first, None, K)
        self.scores.copy_(scores)
        self.hist.copy_(self.hist.index_select(0, rows))
        self.hist.index_copy_(1, c.pos, tokens[:, None])
        c.tokens.copy_(tokens)
        c.reorder_all(rows)
        c.pos.add_(1)
        return self.scores

    def run(self, t: int, forced: bool) -> None:
        """Step t; `forced`: some sentence is at its limit from here on."""
        if self.cache.use_graph:
            self.steps[forced]()
        else:
            self._step(forced)

    def done(self, t: int) -> torch.Tensor:
        """(B,) whether each sentence has K finished hypotheses or has reached its limit after step t."""
        return (self.finals.count.index_select(0, self.sent) >= self.K) | (self.limits <= t + 1)

    def narrowed(self, keep: np.ndarray, written: int) -> "StaticBeam":
        """This loop's sentences `keep` (n,) on a state of their own (StaticCache.narrowed), after
        `written` steps: their scores, histories and caps, the batch's finished hypotheses; its graphs
        are captured anew (a step's shapes are the state's)."""
        dev = self.limits.device
        sents = hostsync.to_device(torch.from_numpy(keep), dev)  # (n,)
        rows = (sents[:, None] * self.K + torch.arange(self.K, device=dev)).view(-1)  # (n * K,)
        state = self.state  # the batch's: it holds the narrower cache from here on, and the wider one goes
        state.cache = self.cache.narrowed(sents, rows, written)
        new = StaticBeam(state, self.limits.index_select(0, sents), self.s, self.finals,
                         self.sent.index_select(0, sents))
        new.scores.copy_(self.scores.index_select(0, sents))
        new.hist.copy_(self.hist.index_select(0, rows))
        return new
