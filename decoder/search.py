"""Greedy and beam search over a decoder state (decoder/cache.py).

A state has `step(tokens (rows,), t) -> logits (rows, V)`, `reorder(rows)`,
`keep(sentences, rows)` and `can_shrink`; the searches own nothing else. Which
kernels they call was resolved once at load time (`Search.plan`). `limits` (B,) is the
most target tokens a sentence may have including </s> (a·src_len + b, capped):
at the last allowed step </s> is forced, so every sentence ends.

With a lexical shortlist the logits cover only the batch's candidates: column j
is token `vocab[j]` (`vocab` (C,) ascending, </s> among them). The searches pick
columns and map them back at once, so histories and outputs are real ids.

Two forms of each loop, the plan's `sync_every` picks: `greedy` and
`beam_search` read the finished rows to the host every step (CPU: a read is a
memory access, and these are the measured fastest); `greedy_device` and
`beam_device` keep that bookkeeping on the device and read it every
`sync_every` steps, plus the outputs once per batch (CUDA: each read stops the
host until the GPU has caught up), which they hand over unread (`Outputs`). Every
read goes through decoder/hostsync.py. Which loop runs a batch is decided once
per plan in decoder/loops.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import hostsync
from .optimisations import Plan

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Search:
    """Everything a search needs besides the state and the batch, fixed at load time."""
    plan: Plan
    start_id: int
    eos_id: int
    pad_id: int
    beam: int = 1
    length_penalty: float = 1.0
    shrink_ratio: float = 0.25  # finished rows leave once this fraction has finished
    no_repeat_ngram: int = 0    # >0: no n-gram of this size twice (fairseq's no_repeat_ngram_size)


class Outputs:
    """A batch's output ids (one list per sentence), made by `finish()` where they are
    used: the device-style loops' outputs come through hostsync.later, so the host
    can queue the next batch before this one's copy has landed."""

    def __init__(self, finish):
        self.finish, self.value = finish, None

    @staticmethod
    def of(out) -> "Outputs":
        return out if isinstance(out, Outputs) else Outputs(lambda: out)

    def result(self) -> list[list[int]]:
        if self.finish is not None:
            self.value, self.finish = self.finish(), None
        return self.value


def greedy(state, limits, s: Search, vocab=None, lims=None) -> list[list[int]]:
    """Argmax decoding; returns token ids without </s>, one list per sentence.

    With `plan.argmax_in_step` the state returns the argmax columns itself
    (`step(..., best=True)`: projection and argmax fused, the logits never written).

    Finished rows are fed <pad> until at least `shrink_ratio` of the rows are
    finished, then they leave the batch together: every shrink copies the live
    K/V cache, so shrinking per sentence costs more than it saves."""
    B, dev = limits.shape[0], limits.device
    p, eos_id = s.plan, s.eos_id
    tokens = torch.full((B,), s.start_id, dtype=torch.long, device=dev)
    alive = torch.arange(B)  # input sentence of each row
    hist = torch.empty((B, 0), dtype=torch.long, device=dev)  # (rows, t)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    out: list = [None] * B
    shrink = p.early_stop and state.can_shrink
    for t in range(max(lims)):
        if p.argmax_in_step:
            nxt = state.step(tokens, t, best=True)  # (rows,)
        else:
            logits = p.normalise(state.step(tokens, t))  # (rows, V)
            if s.no_repeat_ngram:
                p.block(logits, hist, s.no_repeat_ngram, vocab)
            nxt = p.argmax(logits)
        if vocab is not None:
            nxt = vocab[nxt]
        nxt = torch.where(limits <= t + 1, eos_id, nxt)
        nxt = torch.where(done, s.pad_id, nxt)
        hist = torch.cat([hist, nxt[:, None]], 1)
        fin = nxt == eos_id
        if hostsync.item(fin.any(), "finished?"):
            for r in hostsync.to_list(fin.nonzero()[:, 0], "finished rows"):
                out[int(alive[r])] = hostsync.to_list(hist[r, :-1], "output")
            done |= fin
            n_done = hostsync.item(done.sum(), "finished count")
            if n_done == done.numel():
                break
            if shrink and n_done >= s.shrink_ratio * done.numel():
                keep = (~done).nonzero()[:, 0]
                state.keep(keep, keep)
                alive, hist, limits, nxt, done = (alive[hostsync.to_cpu(keep, "finished rows")], hist[keep],
                                                  limits[keep], nxt[keep], done[keep])
        tokens = nxt
    return out


def greedy_one(state, limit: int, s: Search, vocab=None) -> list[int]:
    """`greedy` for one sentence (the latency mode; decoder/cache.py OneRowCache):
    the token and the output are Python ints, so a step is the model's ops and
    nothing else. Same picks as `greedy`: it stops at </s> or at `limit`, whose
    last step only forces </s> and so is not run."""
    p, eos_id = s.plan, s.eos_id
    tok, out = s.start_id, []
    ids = None if vocab is None else hostsync.to_list(vocab, "shortlist")  # column -> id, no tensor op a step
    for t in range(limit - 1):
        if p.argmax_in_step:
            col = state.step(tok, t, best=True)  # (1,)
        else:
            logits = p.normalise(state.step(tok, t))  # (1, V)
            if s.no_repeat_ngram:
                p.block(logits, torch.tensor([out], dtype=torch.long, device=logits.device), s.no_repeat_ngram,
                        vocab)
            col = p.argmax(logits)
        if not isinstance(col, int):
            col = hostsync.item(col, "token")
        tok = col if ids is None else ids[col]
        if tok == eos_id:
            break
        out.append(tok)
    return out


def beam_search(state, limits, s: Search, vocab=None, lims=None) -> list[list[int]]:
    """fairseq-style beam: log-softmax + top-2k over beam x vocab; a sentence is
    finished once `beam` hypotheses ended; best by score / len**length_penalty.
    `plan.topk` (fused_topk, fused_log_softmax) replaces the add and the top-2k, and
    `plan.project_topk` (fused_project_topk) the output projection too (decoder/optimisations.py,
    `scored_step`); steps that force </s> use the plain path.

    The per-sentence bookkeeping (limits, finished, done) lives in Python lists:
    a step's tensor ops are the ones on (sentences, 2K) picks, no host syncs but
    the one that tells whether a hypothesis ended."""
    B, K, dev = limits.shape[0], s.beam, limits.device
    p, eos_id = s.plan, s.eos_id
    tokens = torch.full((B * K,), s.start_id, dtype=torch.long, device=dev)
    scores = torch.zeros(B, K, device=dev)  # (sentences, beam) summed log-probs
    scores[:, 1:] = NEG_INF  # all beams start equal: keep one
    hist = torch.empty((B * K, 0), dtype=torch.long, device=dev)  # (rows, t)
    finals: list[list] = [[] for _ in range(B)]
    alive = list(range(B))
    lims = list(lims)  # the limits as Python ints: no tensor op to test them
    done = [False] * B
    first = torch.arange(B, device=dev)[:, None] * K  # (sentences, 1) each sentence's first row
    shrink = p.early_stop and state.can_shrink
    eos_c = eos_column(vocab, eos_id)
    for t in range(max(lims)):
        nb = len(alive)
        forced = min(lims) <= t + 1  # some sentence's last allowed step: only </s>
        top_s, top_i, V = scored_step(state, s, tokens, t, scores, limits, hist, K, eos_c if forced else None, vocab)
        n_top = top_s.shape[1]
        src_beam, col = top_i // V, top_i % V
        is_eos = col == eos_c  # the shortlist maps columns to ids in ascending order: only eos_c is </s>
        ends = is_eos[:, :K] & (top_s[:, :K] > NEG_INF)
        if hostsync.item(ends.any(), "finished?"):
            for b, j in hostsync.to_list(ends.nonzero(), "finished rows"):
                fb = finals[alive[b]]
                if len(fb) < K and not done[b]:
                    r = b * K + hostsync.item(src_beam[b, j], "finished rows")
                    fb.append((hostsync.item(top_s[b, j], "score") / (t + 1) ** s.length_penalty,
                               hostsync.to_list(hist[r], "output")))
        if t == 0:
            rank, rank_eos = torch.arange(n_top, device=dev), torch.arange(n_top, 2 * n_top, device=dev)
        scores, rows, tokens, hist = advance(top_s, col, src_beam, torch.where(is_eos, rank_eos, rank),
                                             first[:nb], hist, vocab, K)
        # forced </s> ends a sentence even if fewer than K hypotheses were finite
        done = [len(finals[a]) >= K or lim <= t + 1 for a, lim in zip(alive, lims)]
        n_done = sum(done)
        if n_done == nb:
            break
        if shrink and n_done >= max(1.0, s.shrink_ratio * nb):
            keep = [b for b in range(nb) if not done[b]]
            _, scores, limits, tokens, hist = leave(state, keep, rows, first, scores, limits, tokens, hist)
            alive, lims, done = [alive[b] for b in keep], [lims[b] for b in keep], [False] * len(keep)
        else:
            state.reorder(rows)
    return [max(f, key=lambda s: s[0])[1] for f in finals]


def leave(state, keep: list[int], rows, first, scores, limits, tokens, hist):
    """Only the sentences `keep` (of the step's nb) go on: the cache reordered to `rows` and
    shrunk in one gather, and the per-sentence and per-row tensors cut to match.
    -> (kept (nk,), scores, limits, tokens, hist)."""
    nb, K = scores.shape
    kd = torch.tensor(keep, device=scores.device)  # (nk,)
    state.keep(kd, rows.view(nb, K)[kd].view(-1))
    krows = (first[kd] + torch.arange(K, device=scores.device)).view(-1)  # (nk*K,)
    return kd, scores[kd], limits[kd], tokens[krows], hist[krows]


def advance(top_s, col, src_beam, ranks, first, hist, vocab, K: int):
    """`pick`, and the histories reordered and extended (nb*K, t+1)."""
    scores, rows, tokens = pick(top_s, col, src_beam, ranks, first, vocab, K)
    return scores, rows, tokens, torch.cat([hist.index_select(0, rows), tokens[:, None]], 1)


def pick(top_s, col, src_beam, ranks, first, vocab, K: int):
    """The best K continuations that are not </s> (`ranks` (nb, n_top): </s> ranked after
    the rest): their scores (nb, K), the rows they continue (nb*K,), their tokens (nb*K,) as ids."""
    sel = ranks.topk(K, dim=1, largest=False).indices  # (nb, K) by score
    rows = (first + src_beam.gather(1, sel)).view(-1)
    tokens = col.gather(1, sel).view(-1)
    if vocab is not None:
        tokens = vocab.index_select(0, tokens)
    return top_s.gather(1, sel), rows, tokens


def scored_step(state, s: Search, tokens, t: int, scores, limits, hist, K: int, forced_col: int | None, vocab):
    """Step t of the beam: the n_top best (score, index in [0, K*V)) per sentence (nb, n_top) and V.
    With `plan.project_topk` the state takes them from the output product's tiles, the logits
    never written (DecoderState.step_topk), unless </s> is forced this step (`forced_col`) or
    its output layer has no such path; the plan never holds it with n-gram blocking, which
    needs the whole row. Else the logits (nb*K, V) are written, blocked and `beam_top` picks."""
    p = s.plan
    if p.project_topk and forced_col is None:
        V = state.columns
        top = state.step_topk(tokens, t, scores.view(-1), K, min(2 * K, K * V))
        if top is not None:
            return (*top, V)
    logits = state.step(tokens, t)  # (nb*K, V), or (nb*K, C) with a shortlist
    V = logits.shape[-1]
    if s.no_repeat_ngram:  # before the normalisation, so fused and plain top-k agree
        p.block(logits, hist, s.no_repeat_ngram, vocab)
    n_top = min(2 * K, K * V)  # a tiny shortlist can have fewer than 2K columns in all
    return (*beam_top(p, logits, scores, limits, K, n_top, t, forced_col), V)


def beam_top(p: Plan, logits, scores, limits, K: int, n_top: int, t: int, forced_col: int | None):
    """The n_top best (score, index in [0, K*V)) per sentence (nb, n_top) of log_softmax(logits) (nb*K, V)
    + scores (nb, K). `forced_col`: some sentence's last allowed step, so the sentences at their limit
    (limits (nb,) <= t+1) keep only that column (</s>); those steps take the plain path."""
    nb, V = scores.shape[0], logits.shape[-1]
    if p.topk is not None and forced_col is None:
        return p.topk(logits, scores.view(-1), K, n_top)  # (nb, n_top)
    # over a shortlist this normalises over the candidates only (as Marian does)
    cand = torch.log_softmax(logits.float(), -1).view(nb, K, V) + scores[..., None]
    if forced_col is not None:  # torch.where, not a mask assignment: no host read on CUDA
        other = torch.arange(V, device=cand.device) != forced_col  # (V,)
        cand = torch.where((limits <= t + 1)[:, None, None] & other, NEG_INF, cand)
    return cand.view(nb, K * V).topk(n_top, dim=1)  # (nb, n_top)


def eos_column(vocab, eos_id: int) -> int:
    """</s>'s column: its id, or its index in the shortlist's candidates `vocab` (C,)."""
    if vocab is None:
        return eos_id
    c, = hostsync.to_list(torch.searchsorted(vocab, torch.tensor([eos_id], device=vocab.device)), "shortlist")
    if c >= vocab.numel() or hostsync.item(vocab[c], "shortlist") != eos_id:
        raise ValueError("the shortlist candidates must include </s>")
    return c


# -- the device-style loops: the host reads every plan.sync_every steps ---------------------------

def checkpoint(t: int, T: int, every: int) -> bool:
    """Whether the host reads the finished rows after step t (of at most T)."""
    return (t + 1) % every == 0 or t + 1 == T


def greedy_device(state, limits, s: Search, vocab=None, lims=None) -> Outputs:
    """`greedy`'s picks with the finished-row bookkeeping on the device: each
    step writes its tokens into `out` (sentences, T) by input sentence; the
    host reads the done mask every `plan.sync_every` steps (all done? shrink?)
    and the whole batch's outputs once at the end. Finished rows are fed <pad>
    until a read lets them leave, so their outputs never change."""
    B, dev, T = limits.shape[0], limits.device, max(lims)
    p, eos_id, every = s.plan, s.eos_id, s.plan.sync_every
    tokens = torch.full((B,), s.start_id, dtype=torch.long, device=dev)
    sent = torch.arange(B, device=dev)  # (rows,) input sentence of each row
    out = torch.full((B, T), s.pad_id, dtype=torch.long, device=dev)  # (sentences, T) tokens, </s> included
    done = torch.zeros(B, dtype=torch.bool, device=dev)  # (rows,)
    shrink, t = p.early_stop and state.can_shrink, -1
    for t in range(T):
        if p.argmax_in_step:
            nxt = state.step(tokens, t, best=True)  # (rows,)
        else:
            logits = p.normalise(state.step(tokens, t))  # (rows, V)
            if s.no_repeat_ngram:
                p.block(logits, out.index_select(0, sent)[:, :t], s.no_repeat_ngram, vocab)
            nxt = p.argmax(logits)
        if vocab is not None:
            nxt = vocab[nxt]
        nxt = torch.where(limits <= t + 1, eos_id, nxt)
        nxt = torch.where(done, s.pad_id, nxt)
        out[sent, t] = nxt
        done = done | (nxt == eos_id)
        tokens = nxt
        if not checkpoint(t, T, every):
            continue
        fin = hostsync.to_list(done, "finished mask")
        n_done = sum(fin)
        if n_done == len(fin):
            break
        if shrink and n_done >= s.shrink_ratio * len(fin):
            keep = torch.tensor([r for r, f in enumerate(fin) if not f], device=dev)
            state.keep(keep, keep)
            sent, limits, tokens, done = sent[keep], limits[keep], tokens[keep], done[keep]
    rows = hostsync.later(out[:, :t + 1], "outputs")
    return Outputs(lambda: rows.until(eos_id))


class Finals:
    """beam_device's finished hypotheses, on the device: per input sentence up to K
    (summed log-prob, length, tokens), in the order `beam_search` appends them;
    slot K of each sentence takes the ends that are not kept."""

    def __init__(self, B: int, K: int, T: int, pad_id: int, dev):
        self.K = K
        self.score = torch.full((B * (K + 1),), NEG_INF, device=dev)  # (B*(K+1),) raw, not normalised
        self.tokens = torch.full((B * (K + 1), T + 1), pad_id, dtype=torch.long, device=dev)  # length, tokens
        self.count = torch.zeros(B, dtype=torch.long, device=dev)  # (B,) kept so far

    def add(self, t, sent, ends, top_s, hist, src_rows):
        """Step t's ends (nb, K) (of the first K picks, finite) of the sentences `sent` (nb,): kept while
        a sentence has fewer than K and had not reached its limit before this step (`ends` says)."""
        K, c = self.K, self.count.index_select(0, sent)  # (nb,)
        slot = c[:, None] + ends.long().cumsum(1) - 1  # (nb, K) the slot each end would take
        kept = ends & (slot < K)
        where = (sent[:, None] * (K + 1) + torch.where(kept, slot, K)).view(-1)  # (nb*K,)
        self.score[where] = top_s[:, :K].reshape(-1)
        self.tokens[where, 0] = t  # t: an int, or the fixed-shape loops' position tensor (1,)
        if hist.shape[1]:  # the first t columns are the tokens so far (static_steps: all T, the rest unread)
            self.tokens[where, 1:1 + hist.shape[1]] = hist.index_select(0, src_rows)
        self.count.index_copy_(0, sent, c + kept.sum(1))

    def best(self, length_penalty: float, steps: int) -> Outputs:
        """Each sentence's best by score / (length+1)**length_penalty, the first of equals,
        after `steps` steps: two host reads for the whole batch (hostsync.later), the
        arithmetic in Python floats as `beam_search`'s."""
        K1 = self.K + 1
        scores = hostsync.later(self.score.view(-1, K1)[:, :-1], "outputs")
        rows = hostsync.later(self.tokens[:, :steps + 1], "outputs")
        return Outputs(lambda: pick_best(scores.tolist(), rows.array(), K1, length_penalty))


def pick_best(scores: list, rows: np.ndarray, K1: int, length_penalty: float) -> list[list[int]]:
    """Finals.best's choice, from its two reads: scores (B, K) and rows (B*K1, 1 + steps), each row its
    length and tokens. Only the chosen rows become lists: the text pipeline's thread runs this, and
    a tolist of every row (K1 a sentence, each as long as the batch's steps) held the GIL from the
    decoding thread for tens of milliseconds a batch."""
    lengths, out = rows[:, 0].tolist(), []
    for b, sc in enumerate(scores):
        _, j = max(((x / (lengths[b * K1 + j] + 1) ** length_penalty, j) for j, x in enumerate(sc) if x > NEG_INF),
                   key=lambda c: c[0])  # the first of equals
        out.append(rows[b * K1 + j, 1:lengths[b * K1 + j] + 1].tolist())
    return out


def beam_device(state, limits, s: Search, vocab=None, lims=None) -> Outputs:
    """`beam_search`'s picks with the finished hypotheses kept on the device (`Finals`):
    the host reads which sentences are done every `plan.sync_every` steps (all
    done? shrink?), and the outputs once at the end. A done sentence's rows go on
    until a read lets them leave; nothing they do is kept."""
    B, K, dev, T = limits.shape[0], s.beam, limits.device, max(lims)
    p, every = s.plan, s.plan.sync_every
    tokens = torch.full((B * K,), s.start_id, dtype=torch.long, device=dev)
    scores = torch.zeros(B, K, device=dev)  # (sentences, beam) summed log-probs
    scores[:, 1:] = NEG_INF  # all beams start equal: keep one
    hist = torch.empty((B * K, 0), dtype=torch.long, device=dev)  # (rows, t)
    finals = Finals(B, K, T, s.pad_id, dev)
    sent, lims = torch.arange(B, device=dev), list(lims)  # (nb,) input sentence of each live one; its limit
    first = torch.arange(B, device=dev)[:, None] * K  # (sentences, 1) each sentence's first row
    shrink = p.early_stop and state.can_shrink
    eos_c = eos_column(vocab, s.eos_id)
    for t in range(T):
        nb, forced = len(lims), min(lims) <= t + 1
        top_s, top_i, V = scored_step(state, s, tokens, t, scores, limits, hist, K, eos_c if forced else None, vocab)
        n_top = top_s.shape[1]
        src_beam, col = top_i // V, top_i % V
        is_eos = col == eos_c
        # a sentence past its limit (limits <= t) was done before this step: it keeps nothing
        ends = is_eos[:, :K] & (top_s[:, :K] > NEG_INF) & (limits > t)[:, None]
        finals.add(t, sent, ends, top_s, hist, (first[:nb] + src_beam[:, :K]).view(-1))
        if t == 0:
            rank, rank_eos = torch.arange(n_top, device=dev), torch.arange(n_top, 2 * n_top, device=dev)
        scores, rows, tokens, hist = advance(top_s, col, src_beam, torch.where(is_eos, rank_eos, rank),
                                             first[:nb], hist, vocab, K)
        if checkpoint(t, T, every):
            done = hostsync.to_list((finals.count.index_select(0, sent) >= K) | (limits <= t + 1), "finished mask")
            n_done = sum(done)
            if n_done == nb:
                break
            if shrink and n_done >= max(1.0, s.shrink_ratio * nb):
                keep = [b for b in range(nb) if not done[b]]
                kd, scores, limits, tokens, hist = leave(state, keep, rows, first, scores, limits, tokens, hist)
                sent, lims = sent[kd], [lims[b] for b in keep]
                continue
        state.reorder(rows)
    return finals.best(s.length_penalty, t + 1)
