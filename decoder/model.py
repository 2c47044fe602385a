"""Inference-time Transformer for a model dir (the math of student/model.py).

Pre-norm encoder-decoder in M2M100 layout: x = shared[ids]*sqrt(d) + pos[p]
with fairseq positions p = index + pad_id + 1; per layer x += attn(LN(x)) and
x += fc2(act(fc1(LN(x)))); a final LayerNorm per stack; tied (or lm_head) output.

Two decoder states implement the same `step(tokens, t) -> logits` interface so
the searches (decoder/search.py) do not care which one runs:

- `IncrementalState`: self-attention K/V in one preallocated cache
  (layers, 2, rows, heads, max_len, head_dim) written at position t (gpt-fast);
  cross-attention K/V computed once per sentence and shared by its beams: the
  beams of a sentence are the query positions of one attention call (FastSeq),
  so nothing is copied per beam. Beam reorder is an in-place gather.
- `RecomputeState`: the naive reference: re-runs the whole prefix every step
  with encoder output copied per beam and cross K/V recomputed every time.

Both take an optional output projection `out` (`Model.output_rows`): with a
lexical shortlist (`Shortlist`) the logits then cover only the batch's candidate
ids, and the searches map their picks back through that id list.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import fused, modeldir
from .modeldir import sinusoidal_table
from .quant import DTYPES, Int8Linear, Linear, make_linear


class Attention:
    def __init__(self, w: dict, p: str, precision: str, fused: bool, self_attn: bool, fused_ops: bool):
        lin = lambda n: make_linear(w[f"{p}.{n}.weight"], w[f"{p}.{n}.bias"], precision, fused_ops)  # noqa: E731
        cat = lambda ns: make_linear(torch.cat([w[f"{p}.{n}.weight"] for n in ns]),  # noqa: E731
                                     torch.cat([w[f"{p}.{n}.bias"] for n in ns]), precision, fused_ops)
        self.fused = fused
        if fused and self_attn:
            self.qkv = cat(("q_proj", "k_proj", "v_proj"))
        elif fused:  # cross-attention: q from the decoder, k/v from the encoder
            self.q, self.kv = lin("q_proj"), cat(("k_proj", "v_proj"))
        else:
            self.q, self.k, self.v = lin("q_proj"), lin("k_proj"), lin("v_proj")
        self.out = lin("out_proj")

    def project_qkv(self, x):
        if self.fused:
            return self.qkv(x).chunk(3, dim=-1)
        return self.q(x), self.k(x), self.v(x)

    def project_kv(self, x):
        if self.fused:
            return self.kv(x).chunk(2, dim=-1)
        return self.k(x), self.v(x)


class Norm:
    def __init__(self, w: dict, p: str, eps: float, dtype):
        self.w, self.b, self.eps = w[f"{p}.weight"].to(dtype), w[f"{p}.bias"].to(dtype), eps

    def __call__(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)


class FFN:
    def __init__(self, w: dict, p: str, precision: str, activation: str, fused_ops: bool):
        self.fc1 = make_linear(w[f"{p}.fc1.weight"], w[f"{p}.fc1.bias"], precision, fused_ops)
        self.fc2 = make_linear(w[f"{p}.fc2.weight"], w[f"{p}.fc2.bias"], precision, fused_ops)
        self.relu = activation == "relu"

    def __call__(self, x):
        return self.fc2(self.hidden(x))

    def hidden(self, x, fused_relu: bool = False):
        """act(fc1(x)): the input of fc2."""
        if not self.relu:
            return F.gelu(self.fc1(x))
        if fused_relu and not isinstance(self.fc1, Int8Linear):
            return fused.add_bias_relu(self.fc1.mm(x), self.fc1.b)
        return self.fc1(x, relu=True)  # int8: bias + relu in the int8 op's epilogue


def heads(x, h):
    # (B, T, d) -> (B, h, T, hd)
    B, T, d = x.shape
    return x.view(B, T, h, d // h).transpose(1, 2)


def merge(o):
    # (B, h, T, hd) -> (B, T, d)
    B, h, T, hd = o.shape
    return o.transpose(1, 2).reshape(B, T, h * hd)


class Model:
    """Weights laid out for decoding; built from a model dir by `Model.load`."""

    def __init__(self, cfg: modeldir.ModelConfig, w: dict, *, precision: str = "fp32",
                 device: str = "cpu", fused_qkv: bool = True, fused_ops: bool = True,
                 fused_norm: bool = False, fused_relu: bool = False, fused_attention: bool = False,
                 fused_cache: bool = False):
        a = cfg.arch
        self.fused_norm, self.fused_relu = fused_norm, fused_relu
        self.fused_cache = fused_cache and fused_qkv  # needs the one q|k|v product to split
        # the decode step's attention: C++ kernel for few queries, or ATen's SDPA
        self.attend = fused.decode_attention if fused_attention else (
            lambda q, k, v, mask=None: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        self.cfg, self.arch, self.precision, self.device = cfg, a, precision, torch.device(device)
        self.dtype = DTYPES[precision]  # activations: fp32 around int8 matmuls
        w = {k: v.to(self.device) for k, v in w.items()}
        self.n_heads, self.d = a.n_heads, a.d_model
        self.embed_scale = math.sqrt(a.d_model)
        self.emb = w["shared.weight"].to(self.dtype)  # (V, d)
        self.pos = sinusoidal_table(a.max_positions + cfg.pad_id + 1, a.d_model, cfg.pad_id).to(
            self.device, self.dtype)  # (P, d)
        out_w = w["shared.weight"] if a.tie_embeddings else w["lm_head.weight"]
        self.out_proj = make_linear(out_w, None, precision, fused_ops)
        eps, act = a.layer_norm_eps, a.activation
        self.enc_layers = []
        for i in range(a.encoder_layers):
            p = f"encoder.layers.{i}"
            self.enc_layers.append(dict(
                ln1=Norm(w, f"{p}.self_attn_layer_norm", eps, self.dtype),
                attn=Attention(w, f"{p}.self_attn", precision, fused_qkv, True, fused_ops),
                ln2=Norm(w, f"{p}.final_layer_norm", eps, self.dtype),
                ffn=FFN(w, p, precision, act, fused_ops)))
        self.enc_norm = Norm(w, "encoder.layer_norm", eps, self.dtype)
        self.dec_layers = []
        for i in range(a.decoder_layers):
            p = f"decoder.layers.{i}"
            self.dec_layers.append(dict(
                ln1=Norm(w, f"{p}.self_attn_layer_norm", eps, self.dtype),
                attn=Attention(w, f"{p}.self_attn", precision, fused_qkv, True, fused_ops),
                ln2=Norm(w, f"{p}.encoder_attn_layer_norm", eps, self.dtype),
                cross=Attention(w, f"{p}.encoder_attn", precision, fused_qkv, False, fused_ops),
                ln3=Norm(w, f"{p}.final_layer_norm", eps, self.dtype),
                ffn=FFN(w, p, precision, act, fused_ops)))
        self.dec_norm = Norm(w, "decoder.layer_norm", eps, self.dtype)

    @classmethod
    def load(cls, model_dir: str, **kw) -> "Model":
        cfg, weights, _ = modeldir.load(model_dir)
        return cls(cfg, weights, **kw)

    def embed(self, ids, start: int = 0):
        # ids: (B, T); fairseq positions start at pad_id + 1
        p0 = start + self.cfg.pad_id + 1
        return self.emb[ids] * self.embed_scale + self.pos[p0:p0 + ids.shape[1]]  # (B, T, d)

    def add_norm(self, x, lin, inp, norm):
        """The pre-norm residual step: x + lin(inp), and the next LayerNorm of it.
        With `fused_norm` the bias, the residual add and the norm are one call."""
        if self.fused_norm:
            return fused.add_bias_residual_layernorm(x, lin.mm(inp), lin.b, norm.w, norm.b, norm.eps)
        x = x + lin(inp)
        return x, norm(x)

    def encode(self, src):
        """src (B, S) right-padded -> (encoder output (B, S, d), key mask (B, 1, 1, S))."""
        mask = (src != self.cfg.pad_id)[:, None, None, :]
        x = self.embed(src)  # (B, S, d)
        h, layers = self.n_heads, self.enc_layers
        y = layers[0]["ln1"](x) if layers else x
        for i, L in enumerate(layers):
            q, k, v = L["attn"].project_qkv(y)
            o = F.scaled_dot_product_attention(heads(q, h), heads(k, h), heads(v, h), attn_mask=mask)
            x, y = self.add_norm(x, L["attn"].out, merge(o), L["ln2"])
            nxt = layers[i + 1]["ln1"] if i + 1 < len(layers) else self.enc_norm
            x, y = self.add_norm(x, L["ffn"].fc2, L["ffn"].hidden(y, self.fused_relu), nxt)
        return (y if layers else self.enc_norm(x)), mask

    def logits(self, y, out=None):
        """y (rows, d) -> (rows, V), or (rows, C) through a sliced projection `out`."""
        return self.project(self.dec_norm(y), out)

    def project(self, y, out=None):
        """The output projection of already normalised y (rows, d)."""
        return (self.out_proj if out is None else out)(y)

    def project_argmax(self, y, out=None, chunk: int = 1024, min_rows: int = 8):
        """(rows,) column of the largest logit of already normalised y (rows, d),
        the full logits never written: fp32/bf16 projections go `chunk`
        vocabulary rows at a time (fused.linear_argmax). Below `min_rows` rows
        (batch-1 latency) the chunks cost more than they save: one product, then
        the C++ argmax (decoder/bench_fused.py measures both)."""
        lin = self.out_proj if out is None else out
        if isinstance(lin, Linear) and y.shape[0] >= min_rows:
            return fused.linear_argmax(y, lin.w, lin.b, chunk)
        return fused.argmax_rows(lin(y))

    def output_rows(self, vocab):
        """The output projection restricted to the ids `vocab` (C,), once per batch."""
        return self.out_proj.rows(vocab)


class Shortlist:
    """Vocabulary selection: the target ids a batch may produce.

    The union, over the batch's source tokens, of their shortlists, plus the
    frequent ids and </s>. One union per batch (Marian, CTranslate2): per
    sentence would mean a different projection per row, i.e. no single matmul.
    """

    def __init__(self, offsets, ids, frequent, eos_id: int, device):
        self.offsets, self.ids = offsets.to(device), ids.to(device)  # CSR: (V+1,), (nnz,)
        self.always = torch.cat([frequent, torch.tensor([eos_id])]).to(device)  # (N+1,)
        self.vocab_size = offsets.numel() - 1

    def candidates(self, src):
        """src (B, S) source ids -> the allowed target ids (C,), ascending, </s> among them."""
        u = torch.unique(src)  # (U,)
        start, n = self.offsets[u], self.offsets[u + 1] - self.offsets[u]  # (U,) each
        # index of every listed id: start[i] + 0 .. n[i]-1, flattened over i
        first = torch.cumsum(n, 0) - n  # (U,) where source i's run begins in the flat list
        pos = torch.repeat_interleave(start - first, n) + torch.arange(int(n.sum()), device=src.device)
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool, device=src.device)
        allowed[self.ids[pos]] = True
        allowed[self.always] = True
        return allowed.nonzero()[:, 0]  # (C,)


class IncrementalState:
    """Cached decoding of `beam` rows per sentence; rows of one sentence are adjacent."""

    def __init__(self, model: Model, enc, mask, beam: int, max_len: int, out=None):
        self.m, self.beam, self.mask, self.out = model, beam, mask, out
        B, S, _ = enc.shape
        h, hd = model.n_heads, model.d // model.n_heads
        # cross K/V once per sentence, never per beam: (layers) x (B, h, S, hd)
        self.cross = [tuple(heads(t, h) for t in L["cross"].project_kv(enc)) for L in model.dec_layers]
        self.cache = torch.empty(len(model.dec_layers), 2, B * beam, h, max_len, hd,
                                 dtype=model.dtype, device=enc.device)  # (L, 2, rows, h, T, hd)
        self.t = 0

    def step(self, tokens, t: int, best: bool = False):
        """tokens (rows,) at position t -> logits (rows, V), or (rows, C) with `out`;
        with `best` only each row's argmax column (rows,) (Model.project_argmax)."""
        m, h = self.m, self.m.n_heads
        N = tokens.shape[0]
        B = N // self.beam
        x = m.embed(tokens[:, None], start=t)  # (N, 1, d)
        layers = m.dec_layers
        y = layers[0]["ln1"](x) if layers else m.dec_norm(x)
        for i, L in enumerate(layers):
            kc, vc = self.cache[i, 0], self.cache[i, 1]  # (N, h, T, hd)
            if m.fused_cache:  # one call splits q|k|v and writes k, v at position t
                q = fused.qkv_to_cache_(kc, vc, L["attn"].qkv(y), t)
            else:
                q, k, v = L["attn"].project_qkv(y)
                kc[:, :, t] = k.view(N, h, -1)
                vc[:, :, t] = v.view(N, h, -1)
            o = m.attend(heads(q, h), kc[:, :, :t + 1], vc[:, :, :t + 1])
            x, y = m.add_norm(x, L["attn"].out, merge(o), L["ln2"])
            # beams of a sentence are the query positions: (B, beam, d) against (B, h, S, hd)
            q = L["cross"].q(y).view(B, self.beam, -1)
            ck, cv = self.cross[i]
            o = m.attend(heads(q, h), ck, cv, self.mask)  # (B, h, beam, hd)
            x, y = m.add_norm(x, L["cross"].out, merge(o).view(N, 1, -1), L["ln3"])
            nxt = layers[i + 1]["ln1"] if i + 1 < len(layers) else m.dec_norm
            x, y = m.add_norm(x, L["ffn"].fc2, L["ffn"].hidden(y, m.fused_relu), nxt)
        self.t = t + 1
        if best:
            return m.project_argmax(y[:, 0], self.out)  # (N,)
        return m.project(y[:, 0], self.out)  # (N, V) or (N, C)

    def reorder(self, rows):
        """Row r takes the history of row rows[r] (beam reorder), in place."""
        live = self.cache[:, :, :, :, :self.t]
        live.copy_(live.index_select(2, rows))

    def keep(self, sents, rows):
        """Shrink to the sentences `sents` whose rows (already reordered) are `rows`."""
        # copy only the positions written so far: the rest of the buffer is garbage
        L, two, _, h, T, hd = self.cache.shape
        cache = self.cache.new_empty(L, two, rows.numel(), h, T, hd)
        torch.index_select(self.cache[:, :, :, :, :self.t], 2, rows, out=cache[:, :, :, :, :self.t])
        self.cache = cache
        self.cross = [(k.index_select(0, sents), v.index_select(0, sents)) for k, v in self.cross]
        self.mask = self.mask.index_select(0, sents)


class RecomputeState:
    """Naive decoding: the whole prefix again every step, encoder output per beam row."""

    def __init__(self, model: Model, enc, mask, beam: int, max_len: int, out=None):
        self.m, self.beam, self.out = model, beam, out
        self.enc = enc.repeat_interleave(beam, 0)  # (B*beam, S, d)
        self.mask = mask.repeat_interleave(beam, 0)  # (B*beam, 1, 1, S)
        self.prefix = None  # (rows, t) tokens fed so far

    def step(self, tokens, t: int):
        m, h = self.m, self.m.n_heads
        ys = tokens[:, None] if self.prefix is None else torch.cat([self.prefix, tokens[:, None]], 1)
        self.prefix = ys  # (N, t+1)
        T = ys.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=ys.device).tril()
        x = m.embed(ys)
        for L in m.dec_layers:
            y = L["ln1"](x)
            q, k, v = L["attn"].project_qkv(y)
            o = F.scaled_dot_product_attention(heads(q, h), heads(k, h), heads(v, h), attn_mask=causal)
            x = x + L["attn"].out(merge(o))
            y = L["ln2"](x)
            k, v = L["cross"].project_kv(self.enc)
            o = F.scaled_dot_product_attention(heads(L["cross"].q(y), h), heads(k, h), heads(v, h),
                                               attn_mask=self.mask)
            x = x + L["cross"].out(merge(o))
            x = x + L["ffn"](L["ln3"](x))
        return m.logits(x[:, -1], self.out)  # (N, V) or (N, C)

    def reorder(self, rows):
        self.prefix = self.prefix.index_select(0, rows)

    def keep(self, sents, rows):
        self.prefix = self.prefix.index_select(0, rows)
        self.enc = self.enc.index_select(0, rows)
        self.mask = self.mask.index_select(0, rows)
