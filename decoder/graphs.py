"""Fixed-shape decode steps for CUDA graphs.

`StaticState` is `IncrementalState` with shapes that never change from step to
step: the position arrives in a device tensor, K/V are written with
index_copy_, and every step attends over the whole preallocated cache with a
mask for the positions not written yet. One captured CUDA graph then replays
every step of a batch (kernel launches, not Python, were the GPU's bottleneck).
Rows are fixed too, so finished sentences stay in the batch (fed <pad>) instead
of leaving it. On CPU the same class runs eagerly, which is how the tests check
its math against `IncrementalState`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import IncrementalState, heads, merge


class StaticState(IncrementalState):
    fixed_rows = True  # the searches must not shrink the batch

    def __init__(self, model, enc, mask, beam: int, max_len: int, graphs: bool = True, out=None):
        # a shortlist projection `out` is fixed for the batch, like the graph: it is captured with it
        super().__init__(model, enc, mask, beam, max_len, out)
        self.cache.zero_()  # masked positions still pass through softmax(.) @ V: keep them finite
        N, dev = self.cache.shape[2], enc.device
        self.tokens = torch.zeros(N, dtype=torch.long, device=dev)  # (rows,) static input
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)      # (1,) static input
        self.positions = torch.arange(max_len, device=dev)           # (T,)
        self.use_graph = graphs and dev.type == "cuda"
        self.graph = None
        self.logits = None

    def _step(self):
        m, h = self.m, self.m.n_heads
        N = self.tokens.shape[0]
        B = N // self.beam
        p = self.pos + (m.cfg.pad_id + 1)
        x = (m.emb[self.tokens] * m.embed_scale + m.pos.index_select(0, p))[:, None]  # (N, 1, d)
        # (1, 1, 1, T): 0 up to the current position, -inf after it
        bias = torch.zeros(self.positions.shape, dtype=x.dtype, device=x.device).masked_fill_(
            self.positions > self.pos, float("-inf"))[None, None, None]
        layers = m.dec_layers
        y = layers[0]["ln1"](x) if layers else m.dec_norm(x)
        for i, L in enumerate(layers):
            q, k, v = L["attn"].project_qkv(y)
            kc, vc = self.cache[i, 0], self.cache[i, 1]  # (N, h, T, hd)
            kc.index_copy_(2, self.pos, k.view(N, h, 1, -1))
            vc.index_copy_(2, self.pos, v.view(N, h, 1, -1))
            o = F.scaled_dot_product_attention(heads(q, h), kc, vc, attn_mask=bias)
            # add_norm: with fused_norm / fused_relu their kernels are captured in the graph too
            x, y = m.add_norm(x, L["attn"].out, merge(o), L["ln2"])
            q = L["cross"].q(y).view(B, self.beam, -1)
            ck, cv = self.cross[i]
            o = F.scaled_dot_product_attention(heads(q, h), ck, cv, attn_mask=self.mask)
            x, y = m.add_norm(x, L["cross"].out, merge(o).view(N, 1, -1), L["ln3"])
            nxt = layers[i + 1]["ln1"] if i + 1 < len(layers) else m.dec_norm
            x, y = m.add_norm(x, L["ffn"].fc2, L["ffn"].hidden(y, m.fused_relu), nxt)
        return m.project(y[:, 0], self.out)  # (N, V) or (N, C)

    def step(self, tokens, t: int):
        self.tokens.copy_(tokens)
        self.pos.fill_(t)
        self.t = t + 1
        if not self.use_graph:
            return self._step()
        if self.graph is None:
            # warm up on a side stream (allocator, cuBLAS handles), then capture;
            # the warm-up writes the same K/V the real step writes, so it is harmless
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self._step()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._step()
        self.graph.replay()
        return self.logits.clone()  # the graph overwrites its output buffer next step

    def keep(self, sents, rows):
        raise RuntimeError("StaticState has fixed rows; searches must not shrink it")
