"""`Translator`: the library entry point. Every optimisation is a switch so the
benchmark (decoder/bench.py) can turn them on one at a time."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from typing import Iterable, Iterator

import torch

from . import modeldir
from .batching import make_batches, restore
from .graphs import StaticState
from .model import IncrementalState, Model, RecomputeState, Shortlist
from .pipeline import Text, run
from .quant import int8_pays
from .runtime import retain_freed_memory
from .search import beam_search, greedy
from .workers import WorkerPool


@dataclass
class Options:
    beam: int = 1
    cache: bool = True          # K/V cache + cross K/V once per sentence (else recompute the prefix)
    sort: bool = True           # length-sorted batches (else input order)
    softmax_free: bool = True   # greedy argmax on logits (else log-softmax first)
    early_stop: bool = True     # finished sentences leave the batch
    shrink_ratio: float = 0.25  # ... once this fraction of the rows has finished
    fused_qkv: bool = True      # one matmul for q/k/v (cross: one for k/v)
    fused_ops: bool = True      # C++ int8 linear (quantise + matmul + bias/relu in one call)
    fused_norm: bool = False    # C++ bias + residual + LayerNorm in one call (decoder/fused.py)
    fused_relu: bool = False    # C++ bias + relu after a bias-free fp32/bf16 fc1
    fused_attention: bool = False  # cached decode step: C++ attention for few queries instead of SDPA
    fused_cache: bool = False   # cached decode step: C++ split of q|k|v with k, v written into the cache
    # on by default: faster in every measurement, same output (docs/bench/README.md)
    fused_topk: bool = True     # beam: ATen's log-softmax, then one C++ pass for + score and the top 2k
    #                             (same picks as the plain add + topk, bit for bit)
    fused_log_softmax: bool = False  # ... and the log-softmax inside that pass too: the (beam x V) log-probs
    #                                  are never written, but they round differently (near ties may flip)
    fused_project_argmax: bool = True  # greedy, cached, fp32/bf16: output projection + argmax per
    #                                    vocabulary chunk, the logits never written (not with n-gram blocking)
    fused_argmax: bool = False  # greedy: C++ argmax over the logits
    no_repeat_ngram: int = 0    # >0: no n-gram of this size twice in an output (fairseq's no_repeat_ngram_size)
    fused_ngram: bool = True    # ... checked by the C++ kernel (else the Python reference loop)
    pipeline: bool = True       # text processing in worker threads
    cuda_graphs: bool = True    # on CUDA: fixed-shape steps replayed from one CUDA graph
    static_shapes: bool = False  # the fixed-shape state without graphs, on any device (tests)
    shortlist: bool = False     # output layer over the batch's lexical shortlist (needs the model dir's file)
    retain_memory: bool = True  # glibc keeps freed blocks (no page faults per step); process-wide
    max_tokens: int = 4096      # padded source tokens per batch
    max_sentences: int = 512
    length_penalty: float = 1.0
    max_len_a: float = 1.5      # output cap a * source tokens + b
    max_len_b: int = 10
    chunk_lines: int = 20000    # lines read, sorted and batched together
    workers: int = 0            # CPU: >1 = that many pinned 1-thread processes fed whole batches (workers.py)


def resolve_device_precision(device: str, precision: str) -> tuple[str, str]:
    """(device, precision) that will actually run; falls back to CPU without CUDA."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("warning: CUDA is not available; running on CPU", file=sys.stderr, flush=True)
        device = "cpu"
        if precision == "fp16":
            precision = "auto"
    if precision == "auto":
        if device.startswith("cuda"):
            precision = "fp16"
        else:  # int8 where this CPU runs int8 products fast (VNNI/AVX-512), measured once
            precision = "int8" if int8_pays() else "fp32"
    if device == "cpu" and precision == "fp16":
        raise ValueError("fp16 is a GPU precision; use bf16 or int8 on CPU")
    if device.startswith("cuda") and precision == "int8":
        raise ValueError("int8 is a CPU precision; use fp16 on CUDA")
    if precision not in ("fp32", "bf16", "int8", "fp16"):
        raise ValueError(f"unknown precision {precision!r}")
    return device, precision


class Translator:
    def __init__(self, model_dir: str, *, device: str = "cpu", precision: str = "fp32",
                 threads: int | None = None, **switches):
        self.opts = Options(**switches)
        if self.opts.retain_memory:
            retain_freed_memory()
        if threads:
            torch.set_num_threads(threads)  # process-wide: torch has one intra-op pool
        self.device, self.precision = resolve_device_precision(device, precision)
        cfg, weights, spm_path = modeldir.load(model_dir)
        self.cfg = cfg
        self.text = Text(cfg, spm_path, cfg.arch.max_positions)
        self.shortlist = self.model = self.pool = None
        if self.opts.workers > 1:
            if self.device != "cpu":
                raise ValueError("workers are CPU processes; use one process on CUDA")
            if self.opts.shortlist:
                modeldir.read_shortlist(model_dir, cfg)  # a bad file fails here, once, not in each worker
            # the model lives in the workers only; they get the precision already resolved
            switches = {k: v for k, v in vars(self.opts).items() if k not in ("workers", "pipeline")}
            self.pool = WorkerPool(partial(Translator, model_dir, device="cpu", precision=self.precision,
                                           threads=1, **switches), self.opts.workers)
            return
        self.model = Model(cfg, weights, precision=self.precision, device=self.device,
                           fused_qkv=self.opts.fused_qkv, fused_ops=self.opts.fused_ops,
                           fused_norm=self.opts.fused_norm, fused_relu=self.opts.fused_relu,
                           fused_attention=self.opts.fused_attention, fused_cache=self.opts.fused_cache)
        if self.opts.shortlist:
            self.shortlist = Shortlist(*modeldir.read_shortlist(model_dir, cfg), eos_id=cfg.eos_id,
                                       device=self.model.device)

    # -- token level ---------------------------------------------------------------
    def limits(self, lengths: list[int]) -> torch.Tensor:
        o, a = self.opts, self.cfg.arch
        # same formula (and float32 rounding) as student.model.Transformer.greedy
        n = torch.tensor(lengths, dtype=torch.float)
        return torch.clamp((n * o.max_len_a + o.max_len_b).long(), max=a.max_positions - 1)

    @torch.inference_mode()
    def translate_ids(self, srcs: list[list[int]]) -> list[list[int]]:
        """Source ids (with </s>) of one batch -> target ids (without </s>)."""
        if self.pool is not None:
            return self.pool.submit(srcs).result()
        o, c = self.opts, self.cfg
        S = max(len(s) for s in srcs)
        src = torch.full((len(srcs), S), c.pad_id, dtype=torch.long)
        for i, s in enumerate(srcs):
            src[i, :len(s)] = torch.tensor(s)
        src = src.to(self.model.device)
        limits = self.limits([len(s) for s in srcs]).to(self.model.device)
        enc, mask = self.model.encode(src)
        vocab = out = None
        if self.shortlist is not None:  # one candidate set and one sliced projection per batch
            vocab = self.shortlist.candidates(src)  # (C,)
            out = self.model.output_rows(vocab)
        graphs = o.cuda_graphs and self.model.device.type == "cuda"
        if o.cache and (graphs or o.static_shapes):
            state = StaticState(self.model, enc, mask, o.beam, int(limits.max()), graphs=graphs, out=out)
        else:
            State = IncrementalState if o.cache else RecomputeState
            state = State(self.model, enc, mask, o.beam, int(limits.max()), out=out)
        if o.beam == 1:
            return greedy(state, limits, start_id=c.decoder_start_id, eos_id=c.eos_id, pad_id=c.pad_id,
                          softmax_free=o.softmax_free, early_stop=o.early_stop,
                          shrink_ratio=o.shrink_ratio, vocab=vocab, no_repeat_ngram=o.no_repeat_ngram,
                          fused_ngram=o.fused_ngram, fused_argmax=o.fused_argmax,
                          argmax_in_step=(o.fused_project_argmax and o.softmax_free and not o.no_repeat_ngram
                                          and type(state) is IncrementalState))  # not the graphed step
        return beam_search(state, limits, beam=o.beam, start_id=c.decoder_start_id, eos_id=c.eos_id,
                           length_penalty=o.length_penalty, early_stop=o.early_stop,
                           shrink_ratio=o.shrink_ratio, vocab=vocab, fused_topk=o.fused_topk,
                           fused_log_softmax=o.fused_log_softmax,
                           no_repeat_ngram=o.no_repeat_ngram, fused_ngram=o.fused_ngram)

    # -- text level ----------------------------------------------------------------
    def _compute(self, srcs: list, submit):
        o = self.opts
        idx = [i for i, s in enumerate(srcs) if s is not None]
        batches = make_batches([len(srcs[i]) for i in idx], o.max_tokens, o.max_sentences, o.sort)
        if self.pool is not None:
            # every batch of the chunk is queued first, so the workers never wait on the parent
            work = [self.pool.submit([srcs[idx[j]] for j in b]) for b in batches]
            futs = [submit(lambda w: self.text.decode(w.result()), w) for w in work]
        else:
            futs = [submit(self.text.decode, self.translate_ids([srcs[idx[j]] for j in b]))
                    for b in batches]

        def finish() -> list[str]:
            done = restore(batches, [f.result() for f in futs], len(idx))
            out = [""] * len(srcs)  # empty lines stay empty
            for i, s in zip(idx, done):
                out[i] = s
            return out
        return finish

    def translate_stream(self, lines: Iterable[str]) -> Iterator[str]:
        """One output per input line, in order, produced chunk by chunk."""
        return run(lines, self.opts.chunk_lines, self.text.encode, self._compute,
                   overlap=self.opts.pipeline)

    def translate(self, lines: Iterable[str]) -> list[str]:
        return list(self.translate_stream(lines))

    def close(self) -> None:
        """Stops the worker processes, if any (they also stop when the interpreter exits)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
