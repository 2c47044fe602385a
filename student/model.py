"""Training-time Transformer: pre-norm encoder-decoder in Hugging Face M2M100's layout.

Same module names as M2M100 (without "model."), so `state_dict()` is the
model dir's weight table (decoder/modeldir.py) and converts to HF and
CTranslate2 without renaming: pre-norm layers, a final LayerNorm after each
stack, embeddings scaled by sqrt(d_model), fairseq sinusoidal positions
(sin half then cos half, positions starting at pad_id + 1).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# one definition for training and decoding: the model-dir contract fixes the table
from decoder.modeldir import sinusoidal_table


@dataclass
class ModelArgs:
    vocab_size: int = 8000
    d_model: int = 256
    n_heads: int = 4
    ffn_dim: int = 1024
    encoder_layers: int = 3
    decoder_layers: int = 3
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation: str = "relu"
    max_positions: int = 1024
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    pad_id: int = 1
    eos_id: int = 2
    decoder_start_id: int = 2

    def arch_dict(self) -> dict:
        d = asdict(self)
        return {k: d[k] for k in ("vocab_size", "d_model", "n_heads", "ffn_dim", "encoder_layers",
                                  "decoder_layers", "max_positions", "activation",
                                  "tie_embeddings", "layer_norm_eps")}


PRESETS: dict[str, dict] = {
    # small enough to train on 2 CPU cores in an hour (docs/training.md)
    "teacher-tiny": dict(d_model=256, n_heads=4, ffn_dim=1024, encoder_layers=4, decoder_layers=3),
    "teacher-base": dict(d_model=512, n_heads=8, ffn_dim=2048, encoder_layers=6, decoder_layers=6),
    "teacher-big": dict(d_model=1024, n_heads=16, ffn_dim=4096, encoder_layers=6, decoder_layers=6,
                        dropout=0.3),
    # deep encoder, shallow decoder: decoding cost is in the decoder
    "student-tiny": dict(d_model=256, n_heads=4, ffn_dim=1024, encoder_layers=6, decoder_layers=1),
    "student-6-1": dict(d_model=512, n_heads=8, ffn_dim=2048, encoder_layers=6, decoder_layers=1),
    "student-12-1": dict(d_model=512, n_heads=8, ffn_dim=2048, encoder_layers=12, decoder_layers=1),
}


def preset(name: str, **overrides) -> ModelArgs:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return ModelArgs(**{**PRESETS[name], **overrides})


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        d = a.d_model
        self.n_heads, self.dropout = a.n_heads, a.attention_dropout
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, kv, mask):
        # x: (B, Tq, d), kv: (B, Tk, d), mask: bool (B|1, 1, Tq|1, Tk), True = attend
        B, Tq, d = x.shape
        h = self.n_heads
        q = self.q_proj(x).view(B, Tq, h, -1).transpose(1, 2)     # (B, h, Tq, hd)
        k = self.k_proj(kv).view(B, -1, h, d // h).transpose(1, 2)  # (B, h, Tk, hd)
        v = self.v_proj(kv).view(B, -1, h, d // h).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(o.transpose(1, 2).reshape(B, Tq, d))


class FFNMixin:
    def ffn(self, x):
        h = self.final_layer_norm(x)
        act = F.relu if self.activation == "relu" else F.gelu
        h = self.fc2(self.drop(act(self.fc1(h))))
        return x + self.drop(h)


class EncoderLayer(FFNMixin, nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.self_attn_layer_norm = nn.LayerNorm(a.d_model, eps=a.layer_norm_eps)
        self.fc1, self.fc2 = nn.Linear(a.d_model, a.ffn_dim), nn.Linear(a.ffn_dim, a.d_model)
        self.final_layer_norm = nn.LayerNorm(a.d_model, eps=a.layer_norm_eps)
        self.drop, self.activation = nn.Dropout(a.dropout), a.activation

    def forward(self, x, mask):
        h = self.self_attn_layer_norm(x)
        x = x + self.drop(self.self_attn(h, h, mask))
        return self.ffn(x)


class DecoderLayer(FFNMixin, nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn, self.encoder_attn = Attention(a), Attention(a)
        self.self_attn_layer_norm = nn.LayerNorm(a.d_model, eps=a.layer_norm_eps)
        self.encoder_attn_layer_norm = nn.LayerNorm(a.d_model, eps=a.layer_norm_eps)
        self.fc1, self.fc2 = nn.Linear(a.d_model, a.ffn_dim), nn.Linear(a.ffn_dim, a.d_model)
        self.final_layer_norm = nn.LayerNorm(a.d_model, eps=a.layer_norm_eps)
        self.drop, self.activation = nn.Dropout(a.dropout), a.activation

    def forward(self, y, self_mask, enc, enc_mask):
        h = self.self_attn_layer_norm(y)
        y = y + self.drop(self.self_attn(h, h, self_mask))
        h = self.encoder_attn_layer_norm(y)
        y = y + self.drop(self.encoder_attn(h, enc, enc_mask))
        return self.ffn(y)


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        d = a.d_model
        self.shared = nn.Embedding(a.vocab_size, d, padding_idx=a.pad_id)
        nn.init.normal_(self.shared.weight, mean=0.0, std=d ** -0.5)
        with torch.no_grad():
            self.shared.weight[a.pad_id].zero_()
        self.encoder = Stack([EncoderLayer(a) for _ in range(a.encoder_layers)])
        self.encoder.layer_norm = nn.LayerNorm(d, eps=a.layer_norm_eps)
        self.decoder = Stack([DecoderLayer(a) for _ in range(a.decoder_layers)])
        self.decoder.layer_norm = nn.LayerNorm(d, eps=a.layer_norm_eps)
        if not a.tie_embeddings:
            self.lm_head = nn.Linear(d, a.vocab_size, bias=False)
        self.register_buffer("pos_table", sinusoidal_table(a.max_positions + a.pad_id + 1, d, a.pad_id),
                             persistent=False)
        self.drop = nn.Dropout(a.dropout)
        self.embed_scale = math.sqrt(d)

    def embed(self, ids, start: int = 0):
        # ids: (B, T); positions start at pad_id + 1 like fairseq
        T = ids.shape[1]
        if start + T > self.args.max_positions:
            raise ValueError(f"sequence of {start + T} tokens exceeds max_positions {self.args.max_positions}")
        pos = torch.arange(start, start + T, device=ids.device) + self.args.pad_id + 1
        x = self.shared(ids) * self.embed_scale + self.pos_table[pos]
        return self.drop(x)  # (B, T, d)

    def encode(self, src):
        # src: (B, S) right-padded with pad_id
        enc_mask = (src != self.args.pad_id)[:, None, None, :]  # (B, 1, 1, S)
        x = self.embed(src)
        for layer in self.encoder.layers:
            x = layer(x, enc_mask)
        return self.encoder.layer_norm(x), enc_mask  # (B, S, d)

    def decode(self, tgt_in, enc, enc_mask):
        # tgt_in: (B, T) starting with decoder_start_id
        T = tgt_in.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt_in.device).tril()[None, None]
        y = self.embed(tgt_in)
        for layer in self.decoder.layers:
            y = layer(y, causal, enc, enc_mask)
        return self.output(self.decoder.layer_norm(y))  # (B, T, V)

    def output(self, h):
        w = self.shared.weight if self.args.tie_embeddings else self.lm_head.weight
        return F.linear(h, w)

    def forward(self, src, tgt_in):
        enc, enc_mask = self.encode(src)
        return self.decode(tgt_in, enc, enc_mask)

    @torch.no_grad()
    def greedy(self, src, max_len_a: float = 1.5, max_len_b: int = 10):
        """Plain greedy search recomputing the whole prefix each step: the slow
        reference that dev BLEU uses and the lean decoder is checked against."""
        a = self.args
        enc, enc_mask = self.encode(src)
        B = src.shape[0]
        src_len = (src != a.pad_id).sum(1)
        limit = torch.clamp((src_len.float() * max_len_a + max_len_b).long(), max=a.max_positions - 1)
        ys = torch.full((B, 1), a.decoder_start_id, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        for t in range(int(limit.max())):
            nxt = self.decode(ys, enc, enc_mask)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, a.pad_id), nxt)
            nxt = torch.where(~done & (t + 1 >= limit), torch.full_like(nxt, a.eos_id), nxt)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt == a.eos_id
            if done.all():
                break
        out = []
        for row in ys[:, 1:].tolist():
            out.append(row[:row.index(a.eos_id)] if a.eos_id in row else row)
        return out
