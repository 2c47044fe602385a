"""The two searches, greedy and beam, and the one-row latency step beside them.

Each search is one loop over a decoder state (decoder/state.py). What differs by
device is handed to it, resolved once (decoder/optimisations.py `resolve`): how
often the host reads which rows have finished (`Search.every`: every step on CPU,
where a read is a memory access; every few on CUDA, where a read stops the host until
the GPU has caught up), and whether a block of steps runs eagerly or is replayed
from a CUDA graph (the state's `blocks`: the fixed-shape state of a small batch).
The bookkeeping of finished rows is written once per search, on the device: each
step writes its tokens by position, and the host reads the finished mask at the
reads and the outputs once per batch (`Outputs`). Every read goes through
decoder/hostsync.py.

`limits` (B,) is the most target tokens a sentence may have including </s>
(a·src_len + b, capped): at the last allowed step </s> is forced, so every
sentence ends. With a lexical shortlist the logits cover only the batch's
candidates: column j is token `vocab[j]` (`vocab` (C,) ascending, </s> among
them); the searches map picks back at once, so histories and outputs are real ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import graphs, hostsync

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Search:
    """Everything a search needs besides the state and the batch, fixed by `resolve`."""
    start_id: int
    eos_id: int
    pad_id: int
    beam: int = 1
    length_penalty: float = 1.0
    shrink_ratio: float = 0.25  # finished rows leave once this fraction has finished
    no_repeat_ngram: int = 0    # >0: no n-gram of this size twice (fairseq's no_repeat_ngram_size)
    every: int = 1              # the host reads the finished rows every this many steps
    shrink: bool = True         # finished rows leave the batch (early stop)
    pick: Callable = None       # greedy: (state, tokens, t) -> argmax columns (rows,)
    block: Callable = None      # n-gram blocking of logits, in place
    topk: Callable | None = None  # beam: (logits, scores, K, n) -> top n; None = plain add + topk


class Outputs:
    """A batch's output ids (one list per sentence), made by `finish()` where they are
    used: outputs come through hostsync.later, so the host can queue the next batch
    before this one's copy has landed."""

    def __init__(self, finish):
        self.finish, self.value = finish, None

    @staticmethod
    def of(out) -> "Outputs":
        return out if isinstance(out, Outputs) else Outputs(lambda: out)

    def result(self) -> list[list[int]]:
        if self.finish is not None:
            self.value, self.finish = self.finish(), None
        return self.value


def kept(state, kind: str, make, limits):
    """The state's search of this kind: one kept with a state kept for later batches of its
    shape (graph_reuse: its graphs replay), reset for this batch's limits; else a new one."""
    search = state.cache.loops.get(kind) if state.kept else None
    if search is None:
        search = make()
        if state.kept:
            state.cache.loops[kind] = search
    else:
        search.reset(limits)
    return search


# -- greedy --------------------------------------------------------------------------------------

def greedy(state, limits, s: Search, lims: list[int], vocab=None) -> Outputs:
    """Argmax decoding: token ids without </s>, one list per sentence. Finished rows are
    fed <pad> until a read lets them leave, in groups of at least `shrink_ratio` of the
    rows: every shrink copies the live K/V cache, so shrinking per sentence costs more."""
    T = max(lims)
    g = kept(state, "greedy", lambda: Greedy(state, limits, s, vocab), limits)
    run = g.runner()  # run(t, T): steps t .. t+every-1, eagerly or replayed
    for t in range(0, T, s.every):
        run(t, T)
        fin = hostsync.to_list(g.done, "finished mask")
        n_done = sum(fin)
        if n_done == len(fin):
            break
        if s.shrink and state.can_shrink and n_done >= s.shrink_ratio * len(fin):
            g.keep(torch.tensor([r for r, f in enumerate(fin) if not f], device=limits.device))
    rows, eos_id = hostsync.later(g.out[:, :min(t + s.every, g.out.shape[1])], "outputs"), s.eos_id
    return Outputs(lambda: rows.until(eos_id))


class Greedy:
    """A batch's greedy bookkeeping, on the device at fixed addresses (a captured block
    replays it): each row's next input, its sentence, cap and whether it has finished, and
    the tokens (sentences, T) by position, </s> included."""

    def __init__(self, state, limits, s: Search, vocab):
        B, dev, T = limits.shape[0], limits.device, state.positions
        self.state, self.s, self.vocab = state, s, vocab
        self.limits = limits.clone()  # (rows,)
        self.tokens = torch.full((B,), s.start_id, dtype=torch.long, device=dev)  # (rows,)
        self.sent = torch.arange(B, device=dev)  # (rows,) input sentence of each row
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)  # (rows,)
        self.out = torch.full((B, T), s.pad_id, dtype=torch.long, device=dev)  # (sentences, T)
        self.replay = None
        if state.static:
            state.cache.pos.zero_()

    def reset(self, limits) -> None:
        self.limits.copy_(limits)
        self.tokens.fill_(self.s.start_id)
        self.done.zero_()
        self.out.fill_(self.s.pad_id)
        self.state.cache.pos.zero_()  # only a fixed-shape state's searches are kept

    def runner(self) -> Callable:
        """run(t, T): steps t .. t+every-1 (not past T), eagerly at Python positions; on the
        fixed-shape state a block of `every` steps at its device position, replayed from a
        CUDA graph where it has them (the first block runs eagerly, the second captures)."""
        every = self.s.every
        if not self.state.static:
            def run(t: int, T: int) -> None:
                for i in range(t, min(t + every, T)):
                    self.step(i)
            return run
        if self.state.graphs and self.replay is None:  # Captured holds `block` weakly: no cycle
            self.replay = replayed(self.state, graphs.Captured(self.block, self.state.m, every))
        return lambda t, T: self.run_block()

    def run_block(self):
        """A block of `every` steps on the fixed-shape state, replayed where it has graphs."""
        return self.block(self.s.every) if self.replay is None else self.replay()

    def block(self, every: int):
        pos = self.state.cache.pos
        for _ in range(every):
            self.step(pos)
            pos.add_(1)
        return self.done

    def step(self, t) -> None:
        """Step t: an int, or the fixed-shape state's position tensor (1,), which it advances."""
        s = self.s
        history = self.out.index_select(0, self.sent)[:, :t] if s.no_repeat_ngram else None
        nxt = s.pick(self.state, self.tokens, t, history, self.vocab)  # (rows,) columns
        if self.vocab is not None:
            nxt = self.vocab[nxt]
        nxt = torch.where(self.limits <= t + 1, s.eos_id, nxt)
        nxt = torch.where(self.done, s.pad_id, nxt)
        if isinstance(t, int):
            self.out[self.sent, t] = nxt
        else:  # the fixed-shape state keeps its rows: row r is sentence r
            put_column(self.out, t, nxt)
        self.done |= nxt == s.eos_id
        self.tokens.copy_(nxt)

    def keep(self, rows) -> None:
        """Only the rows `rows` (n,) go on."""
        self.state.keep(rows, rows)
        self.sent, self.limits, self.tokens, self.done = (self.sent[rows], self.limits[rows], self.tokens[rows],
                                                          self.done[rows])


def pick_argmax(normalise, block, n: int) -> Callable:
    """Greedy's pick from the written logits: `normalise` (softmax_free: identity), then
    n-gram blocking of size n where asked, then the argmax."""
    def pick(state, tokens, t, history, vocab):
        logits = normalise(state.step(tokens, t))  # (rows, V)
        if history is not None:
            block(logits, history, n, vocab)
        return logits.argmax(-1)
    return pick


def pick_in_step(state, tokens, t, history, vocab):
    """Greedy's pick with projection and argmax fused: the logits never written."""
    return state.step(tokens, t, best=True)


def greedy_one(state, limit: int, s: Search, vocab=None) -> list[int]:
    """`greedy` for one sentence (the latency step; decoder/state.py OneRowCache): the
    token and the output are Python ints, so a step is the model's ops and nothing
    else. Same picks as `greedy`: it stops at </s> or at `limit`, whose last step only
    forces </s> and so is not run."""
    tok, out = s.start_id, []
    ids = None if vocab is None else hostsync.to_list(vocab, "shortlist")  # column -> id, no tensor op a step
    for t in range(limit - 1):
        history = torch.tensor([out], dtype=torch.long, device=state.m.device) if s.no_repeat_ngram else None
        col = s.pick(state, tok, t, history, vocab)
        if not isinstance(col, int):
            col = hostsync.item(col, "token")
        tok = col if ids is None else ids[col]
        if tok == s.eos_id:
            break
        out.append(tok)
    return out


# -- beam ----------------------------------------------------------------------------------------

def beam(state, limits, s: Search, lims: list[int], vocab=None) -> Outputs:
    """fairseq-style beam: log-softmax + top-2k over beam x vocab; a sentence is finished
    once `beam` hypotheses ended; best by score / len**length_penalty. The host reads
    which sentences are done every `s.every` steps; done sentences' rows go on until a
    read lets them leave, and nothing they do is kept."""
    T = max(lims)
    b = kept(state, "beam", lambda: Beam(state, limits, s, vocab, lims), limits)
    b.lims = list(lims)
    run = b.runner()  # run(t, forced, reorder): one step, eagerly or replayed
    for t in range(T):
        forced = min(b.lims) <= t + 1  # some sentence's last allowed step: only </s>
        read = (t + 1) % s.every == 0 or t + 1 == T
        run(t, forced, not (read and s.shrink and state.can_shrink))
        if not read:
            continue
        done = b.finals.done(b, t)
        n_done = sum(done)
        if n_done == len(done):
            break
        if not (s.shrink and state.can_shrink):
            continue
        if n_done >= max(1.0, s.shrink_ratio * len(done)):
            b.leave([i for i, d in enumerate(done) if not d])
        else:
            state.reorder(b.rows)
    return b.finals.best(s.length_penalty, t + 1)


class Beam:
    """A batch's beam bookkeeping on the device at fixed addresses (a captured step replays it):
    the live sentences' scores, each row's next input and tokens by position, the finished
    hypotheses (`HostFinals` where the host reads every step, else `Finals`)."""

    def __init__(self, state, limits, s: Search, vocab, lims: list[int]):
        B, K, T, dev = limits.shape[0], s.beam, state.positions, limits.device
        self.state, self.s, self.vocab, self.K = state, s, vocab, K
        self.limits = limits.clone()  # (sentences,)
        self.lims = list(lims)        # the same, Python ints
        self.V = state.columns
        self.n_top = min(2 * K, K * self.V)  # a tiny shortlist can have fewer than 2K columns in all
        self.eos_c = eos_column(vocab, s.eos_id)
        self.tokens = torch.empty(B * K, dtype=torch.long, device=dev)  # (rows,)
        self.scores = torch.empty(B, K, device=dev)  # (sentences, beam) summed log-probs
        # (rows, t) the tokens so far; the fixed-shape state's at a fixed address, (rows, T) by position
        self.hist = torch.empty(B * K, T if state.static else 0, dtype=torch.long, device=dev)
        self.first = torch.arange(B, device=dev)[:, None] * K  # (sentences, 1) each one's first row
        self.sent = torch.arange(B, device=dev)  # (sentences,) input sentence of each live one
        self.rank = torch.arange(self.n_top, device=dev)  # (n_top,) </s> ranked after the rest:
        self.rank_eos = self.rank + self.n_top              # its ranks shifted by n_top
        # a read a step: the host keeps them; else (and in a captured step) the device
        host = s.every == 1 and not state.static
        self.finals = HostFinals(B, K) if host else Finals(B, K, T, s.pad_id, dev)
        self.rows = self.replay = None
        self.reset(limits)

    def reset(self, limits) -> None:
        self.limits.copy_(limits)
        self.tokens.fill_(self.s.start_id)
        self.scores.zero_()
        self.scores[:, 1:] = NEG_INF  # all beams start equal: keep one
        self.hist.fill_(self.s.pad_id)
        self.finals.clear()
        if self.state.static:
            self.state.cache.pos.zero_()

    def runner(self) -> Callable:
        """run(t, forced, reorder): step t eagerly at Python positions; on the fixed-shape state
        at its device position, replayed from one of two CUDA graphs (forced or not) where it has them."""
        if not self.state.static:
            return self.step
        if self.state.graphs and self.replay is None:  # Captured holds `block` weakly: no cycle
            self.replay = {f: replayed(self.state, graphs.Captured(self.block, self.state.m, f)) for f in (False, True)}
        return lambda t, forced, reorder: self.run_block(forced)

    def run_block(self, forced: bool):
        """A step on the fixed-shape state, replayed where it has graphs (two: </s> forced or not)."""
        return self.block(forced) if self.replay is None else self.replay[forced]()

    def block(self, forced: bool):
        pos = self.state.cache.pos
        self.step(pos, forced, True)
        pos.add_(1)
        return self.scores

    def step(self, t, forced: bool, reorder: bool):
        """Step t (an int, or the fixed-shape state's position tensor (1,)); `forced`: some sentence
        is at its limit; `reorder`: the state's rows reordered here, else by the caller (`leave`)."""
        K = self.K
        top_s, top_i = scored_step(self, t, forced)  # (nb, n_top)
        src_beam, col = top_i // self.V, top_i % self.V
        is_eos = col == self.eos_c  # the shortlist maps columns to ids in ascending order
        # a sentence past its limit (limits <= t) was done before this step: it keeps nothing
        ends = is_eos[:, :K] & (top_s[:, :K] > NEG_INF) & (self.limits > t)[:, None]
        nb = self.scores.shape[0]
        self.finals.add(t, self.sent, ends, top_s, self.hist, (self.first[:nb] + src_beam[:, :K]).view(-1))
        scores, rows, tokens = pick(top_s, col, src_beam, torch.where(is_eos, self.rank_eos, self.rank),
                                    self.first[:nb], self.vocab, K)
        self.scores.copy_(scores)
        if self.state.static:
            self.hist.copy_(self.hist.index_select(0, rows))
            put_column(self.hist, t, tokens)
        else:  # only the columns so far: a copy of the whole width every step would cost more
            self.hist = torch.cat([self.hist.index_select(0, rows), tokens[:, None]], 1)
        self.tokens.copy_(tokens)
        self.rows = rows
        if reorder:
            self.state.reorder(rows)
        return self.scores

    def leave(self, keep: list[int]) -> None:
        """Only the sentences `keep` go on: the state reordered to this step's rows and shrunk
        in one gather, and the per-sentence and per-row tensors cut to match."""
        nb, K, dev = self.scores.shape[0], self.K, self.scores.device
        kd = torch.tensor(keep, device=dev)  # (nk,)
        self.state.keep(kd, self.rows.view(nb, K)[kd].view(-1))
        krows = (self.first[kd] + torch.arange(K, device=dev)).view(-1)  # (nk*K,)
        self.scores, self.limits, self.sent = self.scores[kd], self.limits[kd], self.sent[kd]
        self.tokens, self.hist = self.tokens[krows], self.hist[krows]
        self.lims = [self.lims[b] for b in keep]
        self.finals.keep(keep)


def replayed(state, graph) -> Callable:
    """A captured block's replay, timed as a decode step (Translator.phase): a replay calls
    no state's `step`, which an eager block's steps time themselves."""
    def replay():
        with state.phase("decode steps"):
            return graph()
    return replay


def put_column(x, t, values) -> None:
    """values (rows,) into column t of x (rows, T): t an int, or a position tensor (1,)."""
    if isinstance(t, int):
        x[:, t] = values
    else:
        x.index_copy_(1, t, values[:, None])


def scored_step(b: Beam, t, forced: bool):
    """Step t of the beam: the n_top best (score, index in [0, K*V)) per sentence (nb, n_top):
    the logits (nb*K, V) written, blocked and `beam_top` picks."""
    s, K, state = b.s, b.K, b.state
    logits = state.step(b.tokens, t)  # (nb*K, V), or (nb*K, C) with a shortlist
    if s.no_repeat_ngram:  # before the normalisation, so fused and plain top-k agree
        s.block(logits, b.hist[:, :t], s.no_repeat_ngram, b.vocab)
    return beam_top(s.topk, logits, b.scores, b.limits, K, b.n_top, t, b.eos_c if forced else None)


def beam_top(topk, logits, scores, limits, K: int, n_top: int, t, forced_col: int | None):
    """The n_top best (score, index in [0, K*V)) per sentence (nb, n_top) of log_softmax(logits) (nb*K, V)
    + scores (nb, K). `forced_col`: some sentence's last allowed step, so the sentences at their limit
    (limits (nb,) <= t+1) keep only that column (</s>); those steps take the plain path."""
    nb, V = scores.shape[0], logits.shape[-1]
    if topk is not None and forced_col is None:
        return topk(logits, scores.view(-1), K, n_top)  # (nb, n_top)
    # over a shortlist this normalises over the candidates only (as Marian does)
    cand = torch.log_softmax(logits.float(), -1).view(nb, K, V) + scores[..., None]
    if forced_col is not None:  # torch.where, not a mask assignment: no host read on CUDA
        other = torch.arange(V, device=cand.device) != forced_col  # (V,)
        cand = torch.where((limits <= t + 1)[:, None, None] & other, NEG_INF, cand)
    return cand.view(nb, K * V).topk(n_top, dim=1)  # (nb, n_top)


def pick(top_s, col, src_beam, ranks, first, vocab, K: int):
    """The best K continuations that are not </s> (`ranks` (nb, n_top): </s> ranked after
    the rest): their scores (nb, K), the rows they continue (nb*K,), their tokens (nb*K,) as ids."""
    sel = ranks.topk(K, dim=1, largest=False).indices  # (nb, K) by score
    rows = (first + src_beam.gather(1, sel)).view(-1)
    tokens = col.gather(1, sel).view(-1)
    if vocab is not None:
        tokens = vocab.index_select(0, tokens)
    return top_s.gather(1, sel), rows, tokens


def eos_column(vocab, eos_id: int) -> int:
    """</s>'s column: its id, or its index in the shortlist's candidates `vocab` (C,)."""
    if vocab is None:
        return eos_id
    c, = hostsync.to_list(torch.searchsorted(vocab, torch.tensor([eos_id], device=vocab.device)), "shortlist")
    if c >= vocab.numel() or hostsync.item(vocab[c], "shortlist") != eos_id:
        raise ValueError("the shortlist candidates must include </s>")
    return c


class HostFinals:
    """The finished hypotheses in Python lists, per input sentence up to K (score / len**lp,
    tokens): where the host reads every step (CPU), a step's only read is whether any ended."""

    def __init__(self, B: int, K: int):
        self.B, self.K = B, K
        self.clear()

    def clear(self) -> None:
        self.lists: list[list] = [[] for _ in range(self.B)]
        self.alive = list(range(self.B))  # input sentence of each live one

    def add(self, t: int, sent, ends, top_s, hist, src_rows) -> None:
        if not hostsync.item(ends.any(), "finished?"):
            return
        for b, j in hostsync.to_list(ends.nonzero(), "finished rows"):
            fb = self.lists[self.alive[b]]
            if len(fb) < self.K:
                r = hostsync.item(src_rows[b * self.K + j], "finished rows")
                fb.append((hostsync.item(top_s[b, j], "score"), t, hostsync.to_list(hist[r, :t], "output")))

    def done(self, b: Beam, t: int) -> list[bool]:
        return [len(self.lists[a]) >= self.K or lim <= t + 1 for a, lim in zip(self.alive, b.lims)]

    def keep(self, keep: list[int]) -> None:
        self.alive = [self.alive[b] for b in keep]

    def best(self, length_penalty: float, steps: int) -> Outputs:
        out = [max(f, key=lambda h: h[0] / (h[1] + 1) ** length_penalty)[2] for f in self.lists]
        return Outputs.of(out)


class Finals:
    """The finished hypotheses on the device: per input sentence up to K (summed log-prob,
    length, tokens), in the order they end; slot K of each sentence takes the ends that are
    not kept. Read once per batch (`best`)."""

    def __init__(self, B: int, K: int, T: int, pad_id: int, dev):
        self.K, self.pad_id = K, pad_id
        self.score = torch.empty((B * (K + 1),), device=dev)  # (B*(K+1),) raw, not normalised
        self.tokens = torch.empty((B * (K + 1), T + 1), dtype=torch.long, device=dev)  # length, tokens
        self.count = torch.empty(B, dtype=torch.long, device=dev)  # (B,) kept so far
        self.clear()

    def clear(self) -> None:
        self.score.fill_(NEG_INF)
        self.tokens.fill_(self.pad_id)
        self.count.zero_()

    def add(self, t, sent, ends, top_s, hist, src_rows) -> None:
        """Step t's ends (nb, K) (of the first K picks, finite) of the sentences `sent` (nb,): kept
        while a sentence has fewer than K."""
        K, c = self.K, self.count.index_select(0, sent)  # (nb,)
        slot = c[:, None] + ends.long().cumsum(1) - 1  # (nb, K) the slot each end would take
        kept = ends & (slot < K)
        where = (sent[:, None] * (K + 1) + torch.where(kept, slot, K)).view(-1)  # (nb*K,)
        self.score[where] = top_s[:, :K].reshape(-1)
        self.tokens[where, 0] = t  # t: an int, or the fixed-shape state's position tensor (1,)
        # the tokens so far: the first t columns (the rest, pad or unread, past each length)
        self.tokens[where, 1:1 + hist.shape[1]] = hist.index_select(0, src_rows)
        self.count.index_copy_(0, sent, c + kept.sum(1))

    def done(self, b: Beam, t: int) -> list[bool]:
        return hostsync.to_list((self.count.index_select(0, b.sent) >= self.K) | (b.limits <= t + 1),
                                "finished mask")

    def keep(self, keep: list[int]) -> None:
        pass  # kept by input sentence: `sent` says where

    def best(self, length_penalty: float, steps: int) -> Outputs:
        """Each sentence's best by score / (length+1)**length_penalty, the first of equals,
        after `steps` steps: two host reads for the whole batch (hostsync.later)."""
        K1 = self.K + 1
        scores = hostsync.later(self.score.view(-1, K1)[:, :-1], "outputs")
        rows = hostsync.later(self.tokens[:, :steps + 1], "outputs")
        return Outputs(lambda: pick_best(scores.tolist(), rows.array(), K1, length_penalty))


def pick_best(scores: list, rows: np.ndarray, K1: int, length_penalty: float) -> list[list[int]]:
    """Finals.best's choice, from its two reads: scores (B, K) and rows (B*K1, 1 + steps), each row its
    length and tokens. Only the chosen rows become lists: the text pipeline's thread runs this, and
    a tolist of every row held the GIL from the decoding thread for tens of milliseconds a batch."""
    lengths, out = rows[:, 0].tolist(), []
    for b, sc in enumerate(scores):
        _, j = max(((x / (lengths[b * K1 + j] + 1) ** length_penalty, j) for j, x in enumerate(sc) if x > NEG_INF),
                   key=lambda c: c[0])  # the first of equals
        out.append(rows[b * K1 + j, 1:lengths[b * K1 + j] + 1].tolist())
    return out
