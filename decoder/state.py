"""Decoding states: one `DecoderState`, four caches.

A state is what the searches (decoder/search.py) drive: `step(tokens, t)`,
`reorder(rows)`, `keep(sentences, rows)` and `can_shrink`. Every state runs the
same decoder layers (decoder/model.py `stack`); they differ only in the cache
the layers attend through:

- `IncrementalCache`: self-attention K/V in one preallocated buffer
  (layers, 2, rows, heads, max_len, head_dim) written at position t (gpt-fast);
  cross-attention K/V computed once per sentence and shared by its beams: the
  beams of a sentence are the query positions of one attention call (FastSeq),
  so nothing is copied per beam. Beam reorder is an in-place gather.
- `RowTableCache` (beam, CPU): the incremental cache whose reorder rewrites a
  (rows, T) table of cache rows instead of moving K/V; the attention kernel
  reads through the table.
- `StaticCache`: the same with shapes that never change from step to step: the
  position arrives in a device tensor, K/V are written with index_copy_, every
  step attends over the whole buffer with a mask for the positions not written
  yet, and rows are fixed (finished sentences stay, fed <pad>). One captured
  CUDA graph then replays every step of a batch; on CPU it runs eagerly, which
  is how the tests check it against the incremental cache. In beam search its
  reorder moves a row table too (switch `kv_row_table`), not the K/V buffer.
  Its searches' whole steps are captured with it (`DecoderState.blocks`).
- `OneRowCache`: the incremental cache for one sentence, greedy (the latency
  mode): Python-int tokens, no padding mask, its own one-query attention.

The naive reference without a cache, the benchmarks' first row, is tools/naive.py.

With a lexical shortlist the state's output projection `out` covers only the
batch's candidate ids (Model.output_rows), and the searches map their picks back.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from .fused import heads, merge
from .model import Model
from .quant import GemvLinear


_UNTIMED = contextlib.nullcontext()


def write_kv(attn, y, kc, vc, t: int):
    """q of y (N, 1, d); k, v written into the cache kc, vc (N, h, T, hd) at position t."""
    q, k, v = attn.project_qkv(y)
    N, h = kc.shape[:2]
    kc[:, :, t] = k.view(N, h, -1)
    vc[:, :, t] = v.view(N, h, -1)
    return q


class IncrementalCache:
    can_shrink = True

    def __init__(self, model: Model, enc, mask, beam: int, max_len: int, cross: list | None = None):
        """enc (B, S, d) the encoder's output, mask (B, 1, 1, S) its keys; `cross`: the (B, h, S, hd)
        cross K/V per decoder layer, already projected (then enc may be None)."""
        self.m, self.plan, self.beam, self.mask = model, model.plan, beam, mask
        B = mask.shape[0]
        h, hd = model.n_heads, model.d // model.n_heads
        # cross K/V once per sentence, never per beam: (layers) x (B, h, S, hd); cross_attend
        # takes them into plan.cross_kv's stores on its first call (the subclasses that attend
        # their own way never pay for that), which hold them from then on
        self.cross = cross if cross is not None else \
            [tuple(heads(t, h) for t in L.cross.project_kv(enc)) for L in model.dec_layers]
        self.cross_kv = None
        self.kv = self.new_kv(len(model.dec_layers), B * beam, h, max_len, hd, model.dtype, mask.device)
        self.t, self.max_len = 0, max_len

    @staticmethod
    def new_kv(L: int, N: int, h: int, T: int, hd: int, dtype, device):
        return torch.empty(L, 2, N, h, T, hd, dtype=dtype, device=device)  # (L, 2, rows, h, T, hd)

    def run(self, tokens, t: int):
        """tokens (rows,) at position t -> decoder output (rows, d)."""
        self.t = t + 1
        return self.m.decode(self.m.embed(tokens[:, None], start=t), self)[:, 0]

    def self_attend(self, i: int, attn, y):
        kc, vc = self.kv[i, 0], self.kv[i, 1]  # (N, h, T, hd)
        q = write_kv(attn, y, kc, vc, self.t - 1)
        return merge(self.plan.attend(heads(q, kc.shape[1]), kc[:, :, :self.t], vc[:, :, :self.t]))

    def cross_attend(self, i: int, attn, y):
        if self.cross_kv is None:
            self.cross_kv = [self.plan.cross_kv(k, v, self.mask, self.plan.attend) for k, v in self.cross]
            self.cross = None
        # beams of a sentence are the query positions: (B, beam, d) against (B, h, S, hd)
        N = y.shape[0]
        q = attn.q(y).view(N // self.beam, self.beam, -1)
        return self.cross_kv[i](q).view(N, 1, -1)

    def reorder(self, rows):
        """Row r takes the history of row rows[r] (beam reorder), in place."""
        live = self.kv[:, :, :, :, :self.t]
        live.copy_(live.index_select(2, rows))

    def keep(self, sents, rows):
        """Shrink to the sentences `sents` whose rows (already reordered) are `rows`."""
        # copy only the positions written so far: the rest of the buffer is garbage
        L, two, _, h, T, hd = self.kv.shape
        kv = self.kv.new_empty(L, two, rows.numel(), h, T, hd)
        torch.index_select(self.kv[:, :, :, :, :self.t], 2, rows, out=kv[:, :, :, :, :self.t])
        self.kv = kv
        self.keep_sentences(sents)

    def keep_sentences(self, sents):
        if self.cross_kv is None:
            self.cross = [(k.index_select(0, sents), v.index_select(0, sents)) for k, v in self.cross]
        else:
            for kv in self.cross_kv:
                kv.keep(sents)
        self.mask = self.mask.index_select(0, sents)


class RowTableCache(IncrementalCache):
    """Beam search that never moves its K/V cache (switch `kv_row_table`).

    A beam reorder gives row r the history of row rows[r]. IncrementalCache
    copies the live cache for that (an index_select and a copy back, a fifth of
    a beam-4 step on the KD student); here it rewrites a table instead:
    `table[r, j]` is the cache row that holds row r's key and value at position
    j, and the attention kernel reads through it (fused.decode_attention's
    `rows`). Each step writes every row's own slot at its position, so the
    columns from t on stay the identity. A shrink (rare) gathers through the
    table once and starts a fresh identity table."""

    def __init__(self, model: Model, enc, mask, beam: int, max_len: int):
        super().__init__(model, enc, mask, beam, max_len)
        self.table = identity_table(self.kv.shape[2], max_len, enc.device)

    def self_attend(self, i: int, attn, y):
        kc, vc = self.kv[i, 0], self.kv[i, 1]  # (N, h, T, hd)
        q = write_kv(attn, y, kc, vc, self.t - 1)
        t = self.t
        return merge(self.plan.attend(heads(q, kc.shape[1]), kc[:, :, :t], vc[:, :, :t],
                                      rows=self.table[:, :t]))

    def reorder(self, rows):
        t = self.t
        self.table[:, :t] = self.table[:, :t].index_select(0, rows)

    def new_kv(self, L: int, N: int, h: int, T: int, hd: int, dtype, device):
        # stored position-major (L, 2, T, rows, h, hd): a step's keys and values are one
        # contiguous block (the write misses no more lines than it fills: the split write
        # 209 -> 124 us at ~180 rows), and a shrink's gather through the table is one
        # index_select of h*hd rows. The view is (L, 2, rows, h, T, hd) as everywhere
        # else: the kernels take any strides but the last.
        return torch.empty(L, 2, T, N, h, hd, dtype=dtype, device=device).permute(0, 1, 3, 4, 2, 5)

    def keep(self, sents, rows):
        t, (L, two, N, h, T, hd) = self.t, self.kv.shape
        src = self.table[:, :t].index_select(0, rows)  # (N', t) cache rows of the kept rows
        n = rows.numel()
        # position j of kept row r is stored row j*N + src[r, j] of (L*2, T*N, h*hd)
        idx = (torch.arange(t, device=src.device)[:, None] * N + src.t()).reshape(-1)  # (t*N',)
        old = self.kv.permute(0, 1, 4, 2, 3, 5).view(L * two, T * N, h * hd)
        kv = self.new_kv(L, n, h, T, hd, self.kv.dtype, self.kv.device)
        new = kv.permute(0, 1, 4, 2, 3, 5).view(L * two, T * n, h * hd)
        for i in range(L * two):
            torch.index_select(old[i], 0, idx, out=new[i, :t * n])
        self.kv = kv
        self.table = identity_table(n, T, src.device)
        self.keep_sentences(sents)


def identity_table(rows: int, T: int, device):
    """(rows, T): every row's keys and values in its own cache row."""
    return torch.arange(rows, device=device)[:, None].repeat(1, T)


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _bias_mask(positions, pos, x):
    """(1, 1, 1, T) for SDPA: 0 up to the current position, -inf after it."""
    return torch.zeros(positions.shape, dtype=x.dtype, device=x.device).masked_fill_(
        positions > pos, float("-inf"))[None, None, None]


def _attend_mask(positions, pos, x):
    """(N, 1, 1, T) for the decode-step attention kernel: True up to the current position."""
    return (positions <= pos).expand(x.shape[0], 1, 1, -1)


class StaticCache(IncrementalCache):
    can_shrink = False  # the graph's shapes are fixed: finished rows stay

    def __init__(self, model: Model, enc, mask, beam: int, max_len: int, graphs: bool = True,
                 cross: list | None = None):
        super().__init__(model, enc, mask, beam, max_len, cross)
        self.kv.zero_()  # masked positions still pass through softmax(.) @ V: keep them finite
        N, dev = self.kv.shape[2], mask.device
        self.tokens = torch.zeros(N, dtype=torch.long, device=dev)  # (rows,) static input
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)      # (1,) static input
        self.positions = torch.arange(max_len, device=dev)           # (T,)
        self.use_graph = graphs and dev.type == "cuda"
        self.bias = None
        # switch graph_attention: the plan's decode-step attention, masked by bools (True = attend);
        # else SDPA, masked by a float bias (the cross mask, bools, serves both)
        self.attend, self.position_mask = ((self.plan.attend, _attend_mask) if model.plan.states.masked_attend
                                           else (_sdpa, _bias_mask))
        # switch kv_row_table, beam: a reorder moves the rows of `table` (rows, T), where row r's key and
        # value at position j live in cache row table[r, j]; without it a reorder copies the whole K/V
        # buffer (every position, written or not: fixed shapes) a step. `own` (rows, 1): each row's own
        self.table = self.own = None
        if beam > 1 and model.plan.states.row_table:
            self.table = identity_table(N, max_len, dev)
            self.own = self.table[:, :1].clone()
        self.loops: dict = {}  # the searches' bookkeeping on it (decoder/search.py `kept`), where kept
        self.kept = False  # kept for later batches of its shape (graph_reuse, `static_cache`)

    def _run(self):
        m = self.m
        # clamped: a block of whole steps may run past the last position, its outputs unused
        p = (self.pos + (m.cfg.pad_id + 1)).clamp_(max=m.pos.shape[0] - 1)
        x = (m.emb[self.tokens] + m.pos.index_select(0, p))[:, None]  # (N, 1, d)
        self.bias = self.position_mask(self.positions, self.pos, x)
        if self.table is not None:  # this step's keys are each row's own, written below
            self.table.index_copy_(1, self.pos, self.own)
        return m.decode(x, self)[:, 0]

    def run(self, tokens, t):
        """tokens (rows,) at position t: an int, or `pos` itself (a captured block advances it)."""
        self.tokens.copy_(tokens)
        if isinstance(t, int):
            self.pos.fill_(t)
            self.t = t + 1
        return self._run()

    def reorder(self, rows):
        """Over the whole buffer: fixed shapes for a captured step (the positions past t
        hold nothing read); with the row table, the table's rows move, not the K/V."""
        if self.table is None:
            self.kv.copy_(self.kv.index_select(2, rows))
        else:
            self.table.copy_(self.table.index_select(0, rows))

    def reload(self, enc, mask):
        """This state for a new batch of its shape: what its captured graph reads (cross K/V,
        mask, the K/V cache) overwritten in place, so the graph replays on the new batch."""
        h = self.m.n_heads
        for (ck, cv), L in zip(self.cross, self.m.dec_layers):
            k, v = L.cross.project_kv(enc)
            ck.copy_(heads(k, h))
            cv.copy_(heads(v, h))
        self.mask.copy_(mask)
        self.kv.zero_()  # the row table needs no reset: each step writes its own column before reading it
        self.t = 0

    def self_attend(self, i: int, attn, y):
        q, k, v = attn.project_qkv(y)
        kc, vc = self.kv[i, 0], self.kv[i, 1]  # (N, h, T, hd)
        N, h = kc.shape[:2]
        self.write(kc, k.view(N, h, 1, -1))
        self.write(vc, v.view(N, h, 1, -1))
        if self.table is None:
            return merge(self.attend(heads(q, h), kc, vc, self.bias))
        return merge(self.attend(heads(q, h), kc, vc, self.bias, self.table))

    def write(self, cache, x) -> None:
        """x (N, h, 1, hd) into cache (N, h, T, hd) at the position."""
        cache.index_copy_(2, self.pos, x)

    def cross_attend(self, i: int, attn, y):
        N = y.shape[0]
        q = attn.q(y).view(N // self.beam, self.beam, -1)
        ck, cv = self.cross[i]
        o = self.attend(heads(q, self.m.n_heads), ck, cv, self.mask)
        return merge(o).view(N, 1, -1)

    def keep(self, sents, rows):
        raise RuntimeError("StaticCache has fixed rows; searches must not shrink it")


class OneRowCache(IncrementalCache):
    """One sentence, greedy: the latency mode (decoder/search.py `greedy_one`).

    The token arrives as a Python int and its embedding is a row lookup, and
    cross-attention takes no mask: one sentence has no padding. At batch 1 a step
    is bound by dispatch, so every op saved here is time saved: where the model runs
    int8 gemv products a layer is one C++ call (switch one_row_layer), the whole step
    another (one_row_step)."""

    def __init__(self, model: Model, enc, mask, beam: int, max_len: int):
        super().__init__(model, enc, mask, beam, max_len)
        # one_row_layer: each decoder layer one C++ call with these arguments (None: `layer`'s ops)
        args = model.one_row_layers() if model.plan.states.one_row_layer else None
        self.layers = None if args is None else [
            (w, self.kv[i, 0], self.kv[i, 1], *self.cross[i], eps, epilogue_bias, isa)
            for i, (w, eps, epilogue_bias, isa) in enumerate(args)]

    def step_argmax(self, out) -> "Callable[[int, int], int] | None":
        """(token, t) -> the argmax column of the step's output over `out` (the output
        GemvLinear, or None for the model's own), the whole step one C++ call (switch
        `one_row_step`); None where it does not apply."""
        m = self.m
        lin = m.out_proj if out is None else out
        lin = lin if isinstance(lin, GemvLinear) else getattr(lin, "gemv", None)
        if not self.m.plan.states.one_row_step or self.layers is None or lin is None:
            return None
        w = [t for layer in self.layers for t in layer[0]]
        caches = [t for layer in self.layers for t in layer[1:5]]
        rules = {layer[5:] for layer in self.layers}  # (eps, epilogue_bias, isa) per layer
        if len(rules) != 1:
            return None  # layers with different eps or bias rules: the per-layer op
        eps, epilogue_bias, isa = rules.pop()
        norm, p0 = m.dec_layers[0].norm1, m.cfg.pad_id + 1
        fixed = (m.emb, m.pos, norm.w, norm.b, norm.eps, w, caches, [lin.wq, lin.w_scale, lin.w_shift], lin.b,
                 isa, eps, epilogue_bias)
        op = torch.ops.decoder_ops.one_row_step

        def step(token: int, t: int) -> int:
            self.t = t + 1
            return op(token, t + p0, t, *fixed)
        return step

    def run(self, token: int, t: int):
        self.t = t + 1
        x = self.m.embed_one(token, t)  # (1, 1, d)
        if self.layers is None:
            return self.m.decode(x, self)[:, 0]  # (1, d)
        y = self.m.dec_layers[0].norm1(x)
        for w, kc, vc, ck, cv, eps, epilogue_bias, isa in self.layers:
            x, y = torch.ops.decoder_ops.one_row_layer(x, y, w, kc, vc, ck, cv, t, isa, eps, epilogue_bias)
        return y.view(1, -1)

    def self_attend(self, i: int, attn, y):
        kc, vc = self.kv[i, 0], self.kv[i, 1]  # (1, h, T, hd)
        q = write_kv(attn, y, kc, vc, self.t - 1)  # (1, 1, d)
        o = self.plan.attend(heads(q, kc.shape[1]), kc[:, :, :self.t], vc[:, :, :self.t])  # (1, h, 1, hd)
        return o.view(1, 1, -1)  # one query: (1, h, 1, hd) is (1, 1, d) in memory

    def cross_attend(self, i: int, attn, y):
        ck, cv = self.cross[i]  # (1, h, S, hd)
        return self.plan.attend(heads(attn.q(y), ck.shape[1]), ck, cv).view(1, 1, -1)

    def reorder(self, rows):
        raise RuntimeError("OneRowCache holds one greedy row; beams use IncrementalCache")

    keep = reorder


class DecoderState:
    """What the searches drive: one decode step over `cache`, then the output layer.
    `phase(name)` is the context each step and shrink runs in (Translator.phase)."""

    def __init__(self, model: Model, cache, out=None, phase=lambda name: _UNTIMED):
        self.m, self.cache, self.out, self.phase = model, cache, out, phase
        # the one-row state's steps take and give Python ints (search.greedy_one)
        self.step_argmax = cache.step_argmax(out) if isinstance(cache, OneRowCache) else None
        self.one_row = isinstance(cache, OneRowCache)  # the latency state: search.greedy_one drives it
        self.static = isinstance(cache, StaticCache)  # fixed shapes: its searches' steps at fixed addresses
        self.graphs = self.static and cache.use_graph  # ... and replayed from CUDA graphs
        self.kept = self.static and cache.kept  # kept for later batches of its shape, with its searches
        self.can_shrink = cache.can_shrink

    @property
    def positions(self) -> int:
        """T: the most positions a batch's rows decode (the cache's length)."""
        return self.cache.max_len

    def step(self, tokens, t, best: bool = False):
        """tokens (rows,) (an int for OneRowCache) at position t -> logits (rows, V), or (rows, C) through a
        shortlist's `out`; with `best` each row's argmax column (rows,) instead,
        the logits never written (Model.project_argmax)."""
        with self.phase("decode steps"):
            if best and self.step_argmax is not None:
                return self.step_argmax(tokens, t)  # an int: the column
            y = self.cache.run(tokens, t)  # (rows, d)
            return self.m.project_argmax(y, self.out) if best else self.m.project(y, self.out)

    @property
    def columns(self) -> int:
        """C: the columns of the step's logits (the vocabulary, or the shortlist's candidates)."""
        return (self.m.out_proj if self.out is None else self.out).out_features

    def reorder(self, rows):
        self.cache.reorder(rows)

    def keep(self, sents, rows):
        with self.phase("batch shrink"):
            self.cache.keep(sents, rows)


CACHES = {"incremental": IncrementalCache, "one_row": OneRowCache, "row_table": RowTableCache}


def new_state(model: Model, enc, mask, beam: int, max_len: int, out=None,
              phase=lambda name: _UNTIMED) -> DecoderState:
    """The state for one batch: the kind `resolve` fixed for its rows (StateOptions.kind). A
    fixed-shape state holds whole blocks of `every` greedy steps."""
    opts = model.plan.states
    kind = opts.kind(enc.shape[0], beam)
    if kind != "static":
        return DecoderState(model, CACHES[kind](model, enc, mask, beam, max_len), out, phase)
    if beam == 1:
        max_len = -(-max_len // opts.every) * opts.every
    return DecoderState(model, static_cache(model, enc, mask, beam, max_len), out, phase)


# batches of at most this many rows keep their static state: a bigger batch spreads its
# capture over many rows, and its buffers are large
STATIC_KEEP_ROWS = 16


def static_cache(model: Model, enc, mask, beam: int, max_len: int) -> StaticCache:
    """The batch's StaticCache: one kept from an earlier batch of the same shape, reloaded
    in place so that its captured graphs replay (switch graph_reuse: `keep_states` states
    kept, the least recently used dropped), else a new one. Built anew per batch, every
    batch paid a capture, an eager warm-up and fresh graph memory: at one sentence a batch,
    most of its time. One batch at a time per model, as the Translator decodes."""
    opts, kept = model.plan.states, model.static_states
    key = (enc.shape[0], enc.shape[1], beam, max_len)  # rows, source length, beam, cache length
    cache = kept.pop(key, None)
    if cache is None:
        cache = StaticCache(model, enc, mask, beam, max_len, graphs=opts.graphs)
    else:
        cache.reload(enc, mask)
    if enc.shape[0] * beam <= STATIC_KEEP_ROWS and opts.keep_states:
        kept[key] = cache
        cache.kept = True
        while len(kept) > opts.keep_states:
            _, old = kept.popitem(last=False)
            old.loops.clear()  # its searches refer to it: freed now, not at the collector's next full pass
    return cache
