"""Ensemble beam search over training-time models loaded from model dirs.

The teacher's search: log-probabilities of every member are averaged per step
(Marian/fairseq ensembles). The lean decoder (decoder/) has no ensemble hook,
so this lives here, built from the training model's own modules with a
self-attention K/V cache; with one model and beam 1 it is exactly
Transformer.greedy (tests/test_distill.py pins that).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from student.model import Transformer


class EnsembleSearch:
    """Beam search for models that share one vocabulary (same spm.model)."""

    def __init__(self, models: list[Transformer], beam: int = 4, length_penalty: float = 1.0,
                 max_len_a: float = 1.5, max_len_b: int = 10):
        a0 = models[0].args
        for m in models[1:]:
            a = m.args
            if (a.vocab_size, a.pad_id, a.eos_id, a.decoder_start_id) != \
               (a0.vocab_size, a0.pad_id, a0.eos_id, a0.decoder_start_id):
                raise ValueError("ensemble members differ in vocabulary or special ids")
        self.models = [m.eval() for m in models]
        self.beam, self.alpha = beam, length_penalty
        self.max_len_a, self.max_len_b = max_len_a, max_len_b

    @torch.no_grad()
    def __call__(self, src: torch.Tensor) -> list[list[int]]:
        # src: (B, S) right-padded; returns the best hypothesis per row, without eos
        a = self.models[0].args
        B, K, dev = src.shape[0], self.beam, src.device
        N = B * K
        # the same length limit as Transformer.greedy, so beam 1 reproduces it
        src_len = (src != a.pad_id).sum(1)
        limit = torch.clamp((src_len.float() * self.max_len_a + self.max_len_b).long(),
                            max=min(m.args.max_positions for m in self.models) - 1)
        limit = limit.repeat_interleave(K)  # (N,)
        states = [self._start(m, src, K) for m in self.models]

        tokens = torch.full((N, 1), a.decoder_start_id, dtype=torch.long, device=dev)  # (N, 1+t)
        scores = torch.zeros(B, K, device=dev)
        scores[:, 1:] = float("-inf")  # all beams start identical: keep one alive
        done = torch.zeros(N, dtype=torch.bool, device=dev)
        for t in range(int(limit.max())):
            lp = sum(self._step(m, st, tokens[:, -1], t) for m, st in zip(self.models, states))
            lp = lp / len(self.models)  # (N, V): averaged log-probabilities
            lp[:, a.pad_id] = float("-inf")  # padding is never a word
            # a finished hypothesis keeps its score and only grows padding
            lp[done] = float("-inf")
            lp[done, a.pad_id] = 0.0
            force = ~done & (t + 1 >= limit)
            lp[force] = float("-inf")
            lp[force, a.eos_id] = 0.0
            V = lp.shape[1]
            cand = (scores.view(N, 1) + lp).view(B, K * V)
            scores, flat = cand.topk(K, dim=1)                     # (B, K)
            origin = flat // V + torch.arange(B, device=dev)[:, None] * K
            origin, nxt = origin.view(N), (flat % V).view(N)
            tokens = torch.cat([tokens[origin], nxt[:, None]], 1)
            done = done[origin] | (nxt == a.eos_id)
            for st in states:
                st["self"] = [(k[origin], v[origin]) for k, v in st["self"]]
            if done.all():
                break

        lengths = (tokens[:, 1:] != a.pad_id).sum(1).clamp(min=1).float()  # eos included
        norm = scores.view(N) / lengths ** self.alpha
        best = norm.view(B, K).argmax(1) + torch.arange(B, device=dev) * K
        out = []
        for row in tokens[best, 1:].tolist():
            out.append(row[:row.index(a.eos_id)] if a.eos_id in row else row)
        return out

    @staticmethod
    def _start(m: Transformer, src, K):
        enc, enc_mask = m.encode(src)  # (B, S, d), (B, 1, 1, S)
        cross = []
        for layer in m.decoder.layers:
            at = layer.encoder_attn
            # cross-attention K/V once per sentence, then shared by its beams
            cross.append((_heads(at.k_proj(enc), at.n_heads).repeat_interleave(K, 0),
                          _heads(at.v_proj(enc), at.n_heads).repeat_interleave(K, 0)))
        return {"cross": cross, "mask": enc_mask.repeat_interleave(K, 0), "self": [None] * len(cross)}

    @staticmethod
    def _step(m: Transformer, st, last, t):
        # last: (N,) the token at position t; returns (N, V) log-probabilities for position t+1
        y = m.embed(last[:, None], start=t)  # (N, 1, d)
        for i, layer in enumerate(m.decoder.layers):
            at = layer.self_attn
            h = layer.self_attn_layer_norm(y)
            q, k, v = (_heads(p(h), at.n_heads) for p in (at.q_proj, at.k_proj, at.v_proj))
            if st["self"][i] is not None:
                k = torch.cat([st["self"][i][0], k], 2)
                v = torch.cat([st["self"][i][1], v], 2)
            st["self"][i] = (k, v)  # (N, h, t+1, hd)
            y = y + at.out_proj(_merge(F.scaled_dot_product_attention(q, k, v)))
            ca = layer.encoder_attn
            h = layer.encoder_attn_layer_norm(y)
            q = _heads(ca.q_proj(h), ca.n_heads)
            ck, cv = st["cross"][i]
            y = y + ca.out_proj(_merge(F.scaled_dot_product_attention(q, ck, cv, attn_mask=st["mask"])))
            y = layer.ffn(y)
        logits = m.output(m.decoder.layer_norm(y))[:, -1].float()
        return torch.log_softmax(logits, -1)


def _heads(x, h):
    B, T, d = x.shape
    return x.view(B, T, h, d // h).transpose(1, 2)  # (B, h, T, hd)


def _merge(o):
    B, h, T, hd = o.shape
    return o.transpose(1, 2).reshape(B, T, h * hd)  # (B, T, d)
