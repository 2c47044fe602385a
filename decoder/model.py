"""Inference-time Transformer for a model dir (the math of student/model.py).

Pre-norm encoder-decoder in M2M100 layout: x = shared[ids]*sqrt(d) + pos[p]
with fairseq positions p = index + pad_id + 1; per layer x += attn(LN(x)),
(decoder: x += cross(LN(x))), x += fc2(act(fc1(LN(x)))); a final LayerNorm per
stack; tied (or lm_head) output.

The layer math is written once (`layer`, `stack`), for the encoder and for every
decoding state: where attention reads its keys and values from is the one thing
that differs, and that is the `ctx` object a layer is given (decoder/cache.py
for decoding, `EncoderContext` here). Which kernels the math calls (fused or
plain) was decided once at load time: `Model.plan` (decoder/optimisations.py).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import graphs, modeldir
from .modeldir import sinusoidal_table
from .optimisations import Plan, bias_in_epilogue
from .quant import DTYPES, Linear, make_linear


class Attention:
    """q/k/v/out projections; with `fused_qkv` one product for q|k|v (self) or k|v (cross)."""

    def __init__(self, w: dict, p: str, linear, fused_qkv: bool, self_attn: bool):
        lin = lambda n: linear(w[f"{p}.{n}.weight"], w[f"{p}.{n}.bias"])  # noqa: E731
        cat = lambda ns: linear(torch.cat([w[f"{p}.{n}.weight"] for n in ns]),  # noqa: E731
                                torch.cat([w[f"{p}.{n}.bias"] for n in ns]))
        self.qkv = self.kv = self.k = self.v = None
        if fused_qkv and self_attn:
            self.qkv = cat(("q_proj", "k_proj", "v_proj"))
        elif fused_qkv:  # cross-attention: q from the decoder, k/v from the encoder
            self.q, self.kv = lin("q_proj"), cat(("k_proj", "v_proj"))
        else:
            self.q, self.k, self.v = lin("q_proj"), lin("k_proj"), lin("v_proj")
        self.out = lin("out_proj")

    def project_qkv(self, x):
        if self.qkv is not None:
            return self.qkv(x).chunk(3, dim=-1)
        return self.q(x), self.k(x), self.v(x)

    def project_kv(self, x):
        if self.kv is not None:
            return self.kv(x).chunk(2, dim=-1)
        return self.k(x), self.v(x)


class Norm:
    def __init__(self, w: dict, p: str, eps: float, dtype):
        self.w, self.b, self.eps = w[f"{p}.weight"].to(dtype), w[f"{p}.bias"].to(dtype), eps

    def __call__(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)


class FFN:
    def __init__(self, w: dict, p: str, linear, activation: str):
        self.fc1 = linear(w[f"{p}.fc1.weight"], w[f"{p}.fc1.bias"])
        self.fc2 = linear(w[f"{p}.fc2.weight"], w[f"{p}.fc2.bias"])
        self.relu = activation == "relu"


@dataclass
class Layer:
    """One encoder layer, or a decoder layer when it has `cross`. norm_mid is the
    LayerNorm after self-attention (before cross-attention in a decoder layer,
    before the FFN in an encoder layer); norm_ffn the one before the FFN."""
    norm1: Norm
    attn: Attention
    norm_mid: Norm
    ffn: FFN
    cross: Attention | None = None
    norm_ffn: Norm | None = None

    @classmethod
    def load(cls, w: dict, p: str, a, linear, fused_qkv: bool, dtype, decoder: bool) -> "Layer":
        eps = a.layer_norm_eps
        norm = lambda n: Norm(w, f"{p}.{n}", eps, dtype)  # noqa: E731
        return cls(norm("self_attn_layer_norm"), Attention(w, f"{p}.self_attn", linear, fused_qkv, True),
                   norm("encoder_attn_layer_norm" if decoder else "final_layer_norm"),
                   FFN(w, p, linear, a.activation),
                   Attention(w, f"{p}.encoder_attn", linear, fused_qkv, False) if decoder else None,
                   norm("final_layer_norm") if decoder else None)


def layer(plan: Plan, L: Layer, i: int, x, y, ctx, nxt):
    """x (N, T, d) the residual stream, y = norm1(x): one layer -> (x', nxt(x')).
    `ctx` supplies attention over the keys and values it keeps (a cache, or the
    whole sequence); `nxt` is the next layer's norm1 or the stack's final norm."""
    x, y = plan.add_norm(x, L.attn.out, ctx.self_attend(i, L.attn, y), L.norm_mid)
    if L.cross is not None:
        x, y = plan.add_norm(x, L.cross.out, ctx.cross_attend(i, L.cross, y), L.norm_ffn)
    return plan.add_norm(x, L.ffn.fc2, plan.hidden(L.ffn, y), nxt)


def stack(plan: Plan, layers: list, x, ctx, final: Norm):
    """x (N, T, d) embedded -> final(output of the last layer) (N, T, d)."""
    if not layers:
        return final(x)
    y = layers[0].norm1(x)
    for i, L in enumerate(layers):
        x, y = layer(plan, L, i, x, y, ctx, layers[i + 1].norm1 if i + 1 < len(layers) else final)
    return y


class EncoderContext:
    """Self-attention over the whole source, padding masked (mask (B, 1, 1, S), True = attend)
    by the plan's `encoder_attend` (SDPA, or the C++ op on the fused q|k|v product)."""

    def __init__(self, plan: Plan, n_heads: int, mask):
        self.plan, self.h, self.mask = plan, n_heads, mask

    def self_attend(self, i: int, attn: Attention, y):
        return self.plan.encoder_attend(attn, y, self.h, self.mask)


class Model:
    """Weights laid out for decoding; built from a model dir by `Model.load`."""

    def __init__(self, cfg: modeldir.ModelConfig, w: dict, plan: Plan, *, precision: str = "fp32",
                 device: str = "cpu"):
        a = cfg.arch
        self.cfg, self.arch, self.plan, self.precision = cfg, a, plan, precision
        self.device = torch.device(device)
        self.dtype = DTYPES[precision]  # activations: fp32 around int8 matmuls
        w = {k: v.to(self.device) for k, v in w.items()}
        linear = lambda wt, b: make_linear(wt, b, precision, plan)  # noqa: E731
        self.n_heads, self.d = a.n_heads, a.d_model
        self.embed_scale = math.sqrt(a.d_model)
        # (V, d), times sqrt(d) once here rather than per step: the same product, rounded the same
        self.emb = w["shared.weight"].to(self.dtype) * self.embed_scale
        self.pos = sinusoidal_table(a.max_positions + cfg.pad_id + 1, a.d_model, cfg.pad_id).to(
            self.device, self.dtype)  # (P, d)
        out_w = w["shared.weight"] if a.tie_embeddings else w["lm_head.weight"]
        self.out_proj = linear(out_w, None)
        load = lambda p, dec: Layer.load(w, p, a, linear, plan.fused_qkv, self.dtype, dec)  # noqa: E731
        self.enc_layers = [load(f"encoder.layers.{i}", False) for i in range(a.encoder_layers)]
        self.dec_layers = [load(f"decoder.layers.{i}", True) for i in range(a.decoder_layers)]
        self.enc_norm = Norm(w, "encoder.layer_norm", a.layer_norm_eps, self.dtype)
        self.dec_norm = Norm(w, "decoder.layer_norm", a.layer_norm_eps, self.dtype)
        # (rows, source length, beam, cache length) -> a StaticCache to reuse (decoder/cache.py static_cache)
        self.static_states: OrderedDict = OrderedDict()
        # CUDA: its graphs' memory pool, the graph that holds it open, their stream (decoder/graphs.py)
        self.graph_pool = self.graph_anchor = self.graph_stream = None
        self.graphs_failed = False  # a capture failed here: steps run eagerly (graphs.Captured)
        self.captures = graphs.Tally()  # this model's graph captures and the host's seconds in them

    def embed(self, ids, start: int = 0):
        # ids: (B, T); fairseq positions start at pad_id + 1
        # F.embedding is an index_select: `emb[ids]` (aten::index) took 42 us at 236 rows, this 9
        p0 = start + self.cfg.pad_id + 1
        return F.embedding(ids, self.emb) + self.pos[p0:p0 + ids.shape[1]]  # (B, T, d)

    def embed_one(self, token: int, t: int):
        """One token id at position t -> (1, 1, d): two row views and one add (`emb[ids]` is an
        aten::index, a third of this at one row)."""
        return (self.emb[token] + self.pos[t + self.cfg.pad_id + 1]).view(1, 1, -1)

    def encode(self, src):
        """src (B, S) right-padded -> (encoder output (B, S, d), key mask (B, 1, 1, S))."""
        mask = (src != self.cfg.pad_id)[:, None, None, :]
        ctx = EncoderContext(self.plan, self.n_heads, mask)
        return stack(self.plan, self.enc_layers, self.embed(src), ctx, self.enc_norm), mask

    def decode(self, x, ctx):
        """Embedded target positions x (N, T, d) through the decoder -> normalised (N, T, d)."""
        return stack(self.plan, self.dec_layers, x, ctx, self.dec_norm)

    def project(self, y, out=None):
        """The output projection of already normalised y (rows, d) -> (rows, V), or
        (rows, C) through a shortlist's sliced projection `out`."""
        return (self.out_proj if out is None else out)(y)

    def project_argmax(self, y, out=None, chunk: int = 1024, min_rows: int = 8):
        """(rows,) column of the largest logit of already normalised y (rows, d),
        the full logits never written: fp32/bf16 projections go `chunk`
        vocabulary rows at a time (linear_argmax). Below `min_rows` rows
        (batch-1 latency) the chunks cost more than they save: one product, then
        the C++ argmax (tools/bench_fused.py measures both). Kernels or references:
        the plan's ops, bound once."""
        lin, ops = self.out_proj if out is None else out, self.plan.ops
        if isinstance(lin, Linear) and y.shape[0] >= min_rows:
            return ops.linear_argmax(y, lin.w, lin.b, chunk)
        return ops.argmax_rows(lin(y))

    def one_row_layers(self) -> list | None:
        """Per decoder layer the arguments of the C++ `one_row_layer` op that
        stay fixed (its 30 weight tensors, eps, where the biases go, the gemv
        ISA), made once; None where the op does not apply: it runs int8 gemv
        linears, one q|k|v product and relu (OneRowCache then runs `layer`). The
        plan calls it only where the C++ ops are loaded (switch one_row_layer)."""
        if not hasattr(self, "_one_row"):
            self._one_row = self._one_row_args()
        return self._one_row

    def _one_row_args(self) -> list | None:
        out = []
        for i, L in enumerate(self.dec_layers):
            lins = [L.attn.qkv, L.attn.out, L.cross.q, L.cross.out, L.ffn.fc1, L.ffn.fc2]
            gemvs = [getattr(lin, "gemv", None) for lin in lins]
            if L.attn.qkv is None or L.cross.q is None or not L.ffn.relu or any(g is None for g in gemvs):
                return None
            nxt = self.dec_layers[i + 1].norm1 if i + 1 < len(self.dec_layers) else self.dec_norm
            w = [t for g in gemvs for t in (g.wq, g.w_scale, g.w_shift,
                                            torch.zeros_like(g.w_scale) if g.b is None else g.b)]
            w += [t.float().contiguous() for n in (L.norm_mid, L.norm_ffn, nxt) for t in (n.w, n.b)]
            out.append((w, L.norm_mid.eps, bias_in_epilogue(L.attn.out), gemvs[0].isa))
        return out

    def output_rows(self, vocab, batch_rows: int = 64):
        """The output projection restricted to the ids `vocab` (C,), once per batch
        of `batch_rows` rows a step (int8 picks its sliced layout by it)."""
        return self.out_proj.rows(vocab, batch_rows)
