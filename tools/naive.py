"""The benchmarks' naive baseline: the decoder with no K/V cache.

`RecomputeCache` runs the whole prefix through the decoder layers again at every
step, copies the encoder output per beam row and projects the cross K/V every
time: what a first PyTorch decoder does. It is the first row of `tools.bench`'s
ablation ladder, the one every speed-up is measured from, and the tests' plain
reference for the cached states of decoder/state.py. `NaiveTranslator` is
`decoder.Translator` with every batch on it; the searches, the layers and the
switches are the decoder's own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from decoder.fused import heads, merge
from decoder.state import DecoderState
from decoder.translator import Translator


class RecomputeCache:
    """No cache: the whole prefix again every step, encoder output per beam row."""
    can_shrink = True

    def __init__(self, model, enc, mask, beam: int, max_len: int):
        self.m, self.max_len = model, max_len
        self.enc = enc.repeat_interleave(beam, 0)  # (B*beam, S, d)
        self.mask = mask.repeat_interleave(beam, 0)  # (B*beam, 1, 1, S)
        self.prefix = None  # (rows, t) tokens fed so far
        self.causal = None

    def run(self, tokens, t: int):
        # a copy: the searches rewrite their token buffer in place
        ys = tokens[:, None].clone() if self.prefix is None else torch.cat([self.prefix, tokens[:, None]], 1)
        self.prefix = ys  # (N, t+1)
        T = ys.shape[1]
        self.causal = torch.ones(T, T, dtype=torch.bool, device=ys.device).tril()  # (T, T)
        return self.m.decode(self.m.embed(ys), self)[:, -1]

    def self_attend(self, i: int, attn, y):
        h = self.m.n_heads
        q, k, v = (heads(t, h) for t in attn.project_qkv(y))
        return merge(F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal))

    def cross_attend(self, i: int, attn, y):
        h = self.m.n_heads
        k, v = attn.project_kv(self.enc)
        o = F.scaled_dot_product_attention(heads(attn.q(y), h), heads(k, h), heads(v, h), attn_mask=self.mask)
        return merge(o)

    def reorder(self, rows):
        self.prefix = self.prefix.index_select(0, rows)

    def keep(self, sents, rows):
        self.prefix = self.prefix.index_select(0, rows)
        self.enc = self.enc.index_select(0, rows)
        self.mask = self.mask.index_select(0, rows)


class NaiveTranslator(Translator):
    """decoder.Translator whose batches run on `RecomputeCache`, in this process."""

    def __init__(self, model_dir: str, **kw):
        if kw.get("workers", 0) > 1:  # the worker processes would build the decoder's own states
            raise ValueError("NaiveTranslator decodes in one process: workers must be 0 or 1")
        super().__init__(model_dir, **kw)

    def new_state(self, e):
        cache = RecomputeCache(self.model, e.enc, e.mask, self.opts.beam, max(e.lims))
        return DecoderState(self.model, cache, e.out, self.phase)
