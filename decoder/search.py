"""Greedy and beam search over a decoder state (decoder/cache.py).

A state has `step(tokens (rows,), t) -> logits (rows, V)`, `reorder(rows)`,
`keep(sentences, rows)` and `can_shrink`; the searches own nothing else. Which
kernels they call was resolved once at load time (`Search.plan`). `limits` (B,) is the
most target tokens a sentence may have including </s> (a·src_len + b, capped):
at the last allowed step </s> is forced, so every sentence ends.

With a lexical shortlist the logits cover only the batch's candidates: column j
is token `vocab[j]` (`vocab` (C,) ascending, </s> among them). The searches pick
columns and map them back at once, so histories and outputs are real ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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

    def run(self, state, limits, vocab=None) -> list[list[int]]:
        if self.beam > 1:
            return beam_search(state, limits, self, vocab)
        if getattr(state, "one_row", False):
            return [greedy_one(state, int(limits[0]), self, vocab)]
        return greedy(state, limits, self, vocab)


def greedy(state, limits, s: Search, vocab=None) -> list[list[int]]:
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
    for t in range(int(limits.max())):
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
        if bool(fin.any()):
            for r in fin.nonzero()[:, 0].tolist():
                out[int(alive[r])] = hist[r, :-1].tolist()
            done |= fin
            n_done = int(done.sum())
            if n_done == done.numel():
                break
            if shrink and n_done >= s.shrink_ratio * done.numel():
                keep = (~done).nonzero()[:, 0]
                state.keep(keep, keep)
                alive, hist, limits, nxt, done = (alive[keep.cpu()], hist[keep], limits[keep],
                                                  nxt[keep], done[keep])
        tokens = nxt
    return out


def greedy_one(state, limit: int, s: Search, vocab=None) -> list[int]:
    """`greedy` for one sentence (the latency mode; decoder/cache.py OneRowCache):
    the token and the output are Python ints, so a step is the model's ops and
    nothing else. Same picks as `greedy`: it stops at </s> or at `limit`, whose
    last step only forces </s> and so is not run."""
    p, eos_id = s.plan, s.eos_id
    tok, out = s.start_id, []
    ids = None if vocab is None else vocab.tolist()  # column -> id without a tensor op per step
    for t in range(limit - 1):
        if p.argmax_in_step:
            col = state.step(tok, t, best=True)  # (1,)
        else:
            logits = p.normalise(state.step(tok, t))  # (1, V)
            if s.no_repeat_ngram:
                p.block(logits, torch.tensor([out], dtype=torch.long, device=logits.device), s.no_repeat_ngram,
                        vocab)
            col = p.argmax(logits)
        tok = int(col) if ids is None else ids[int(col)]
        if tok == eos_id:
            break
        out.append(tok)
    return out


def beam_search(state, limits, s: Search, vocab=None) -> list[list[int]]:
    """fairseq-style beam: log-softmax + top-2k over beam x vocab; a sentence is
    finished once `beam` hypotheses ended; best by score / len**length_penalty.
    `plan.topk` (fused_topk, fused_log_softmax) replaces the add and the top-2k
    (decoder/optimisations.py); steps that force </s> use the plain path.

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
    lims = limits.tolist()  # the same limits as Python ints: no tensor op to test them
    done = [False] * B
    first = torch.arange(B, device=dev)[:, None] * K  # (sentences, 1) each sentence's first row
    beam_ar = torch.arange(K, device=dev)
    shrink = p.early_stop and state.can_shrink
    eos_c = eos_id if vocab is None else int(torch.searchsorted(vocab, eos_id))  # </s>'s column
    if vocab is not None and (eos_c >= vocab.numel() or int(vocab[eos_c]) != eos_id):
        raise ValueError("the shortlist candidates must include </s>")
    for t in range(max(lims)):
        logits = state.step(tokens, t)  # (nb*K, V), or (nb*K, C) with a shortlist
        nb, V = len(alive), logits.shape[-1]
        if s.no_repeat_ngram:  # before the normalisation, so fused and plain top-k agree
            p.block(logits, hist, s.no_repeat_ngram, vocab)
        n_top = min(2 * K, K * V)  # a tiny shortlist can have fewer than 2K columns in all
        forced = min(lims) <= t + 1  # some sentence's last allowed step: only </s>
        if p.topk is not None and not forced:
            top_s, top_i = p.topk(logits, scores.view(-1), K, n_top)  # (nb, n_top)
        else:
            # over a shortlist this normalises over the candidates only (as Marian does)
            cand = torch.log_softmax(logits.float(), -1).view(nb, K, V) + scores[..., None]
            if forced:
                force = limits <= t + 1  # (nb,)
                eos_col = cand[:, :, eos_c].clone()
                cand[force] = NEG_INF
                cand[:, :, eos_c] = torch.where(force[:, None], eos_col, cand[:, :, eos_c])
            top_s, top_i = cand.view(nb, K * V).topk(n_top, dim=1)  # (nb, n_top)
        src_beam, col = top_i // V, top_i % V
        is_eos = col == eos_c  # the shortlist maps columns to ids in ascending order: only eos_c is </s>
        ends = is_eos[:, :K] & (top_s[:, :K] > NEG_INF)
        if bool(ends.any()):
            for b, j in ends.nonzero().tolist():
                fb = finals[alive[b]]
                if len(fb) < K and not done[b]:
                    r = b * K + int(src_beam[b, j])
                    fb.append((float(top_s[b, j]) / (t + 1) ** s.length_penalty, hist[r].tolist()))
        # the best K continuations that are not </s>: the K lowest ranks, </s> ranked after the rest
        if t == 0:
            rank, rank_eos = torch.arange(n_top, device=dev), torch.arange(n_top, 2 * n_top, device=dev)
        sel = torch.where(is_eos, rank_eos, rank).topk(K, dim=1, largest=False).indices  # (nb, K) by score
        scores = top_s.gather(1, sel)
        rows = (first[:nb] + src_beam.gather(1, sel)).view(-1)
        tokens = col.gather(1, sel).view(-1)
        if vocab is not None:
            tokens = vocab.index_select(0, tokens)
        hist = torch.cat([hist.index_select(0, rows), tokens[:, None]], 1)
        # forced </s> ends a sentence even if fewer than K hypotheses were finite
        done = [len(finals[a]) >= K or lim <= t + 1 for a, lim in zip(alive, lims)]
        n_done = sum(done)
        if n_done == nb:
            break
        if shrink and n_done >= max(1.0, s.shrink_ratio * nb):
            keep = [b for b in range(nb) if not done[b]]
            kd = torch.tensor(keep, device=dev)
            rows = rows.view(nb, K)[kd].view(-1)
            state.keep(kd, rows)  # reorder and shrink in one gather
            krows = (first[kd] + beam_ar).view(-1)
            alive, lims, done = [alive[b] for b in keep], [lims[b] for b in keep], [False] * len(keep)
            scores, limits = scores[kd], limits[kd]
            tokens, hist = tokens[krows], hist[krows]
        else:
            state.reorder(rows)
    return [max(f, key=lambda s: s[0])[1] for f in finals]
