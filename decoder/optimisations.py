"""Every decoder optimisation, once: name, default, what it does, what it replaces.

`resolve` turns the switches into a `Plan` once, at load time: each slot of the
plan holds the function (or layout choice) that the decode step calls, so the
step never tests a switch by name (sockeye picks its top-k implementation in
`__init__`; gpt-fast swaps `decode_one_token` once in `main`). The reference a
switch replaces is the slot's value when the switch is off. A slot whose value
calls fused ops (`Bound`) is bound there too, to the kernels' entries or the
PyTorch references of the plan's device and precision (decoder/fused.py `Ops`),
so the step never asks whether a kernel is loaded either. The benchmarks
(tools/), the CLI's --help and decoder/README.md's table are generated from
`OPTIMISATIONS`, so adding an optimisation is one entry here plus its kernel
(decoder/fused.py, decoder/csrc) and its test.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import fused
from .quant import DTYPES, Int8Linear, fbgemm_available, int_mm_vnni, wide_gemm_available


@dataclass(frozen=True)
class Bound:
    """A slot value that calls fused ops: `resolve` binds it once to the plan's
    `fused.Ops` (each op its kernel's entry or its reference). `make(ops)` -> what the
    step calls; `uses`: the names of the ops it calls (Plan.summary: kernel or reference)."""
    make: Callable
    uses: tuple

    def bind(self, ops: fused.Ops) -> Callable:
        return _bind(self, ops)


@functools.lru_cache(maxsize=None)
def _bind(b: Bound, ops: fused.Ops) -> Callable:
    # one callable per (slot value, ops): two plans of one device compare equal
    return b.make(ops)


def op(name: str) -> Bound:
    """The fused op `name` itself."""
    return Bound(operator.attrgetter(name), (name,))


def with_ops(fn, *uses: str) -> Bound:
    """fn(ops, ...), the ops bound."""
    return Bound(lambda ops: partial(fn, ops), uses)


# -- the plain pieces and their optimised replacements ------------------------------------------

def add_norm_plain(x, lin, inp, norm):
    """The pre-norm residual step: x + lin(inp), and the next LayerNorm of it."""
    x = x + lin(inp)
    return x, norm(x)


def bias_in_epilogue(lin) -> bool:
    """Whether the fused norm path takes lin's output with its bias in (fbgemm adds it in
    its epilogue, `zero_b` stands in downstream) rather than adding the bias itself; the
    C++ one-row layer follows the same rule (decoder/model.py `one_row_layers`)."""
    return lin.b is not None and getattr(lin, "zero_b", None) is not None


def add_norm_fused(ops, x, lin, inp, norm):
    if bias_in_epilogue(lin):
        # its whole output and a zero bias round as the plain path
        return ops.add_bias_residual_layernorm(x, lin(inp), lin.zero_b, norm.w, norm.b, norm.eps)
    return ops.add_bias_residual_layernorm(x, lin.mm(inp), lin.b, norm.w, norm.b, norm.eps)


def hidden_plain(ffn, y):
    """act(fc1(y)): the input of fc2; int8 adds bias + relu in its own epilogue."""
    return ffn.fc1(y, relu=True) if ffn.relu else F.gelu(ffn.fc1(y))


def hidden_fused(ops, ffn, y):
    if ffn.relu and ffn.fc1.dense:
        return ops.add_bias_relu(ffn.fc1.mm(y), ffn.fc1.b)
    return hidden_plain(ffn, y)


def hidden_int8(ffn, y):
    """int8 fc1 whose epilogue quantises relu(fc1(y)) for fc2 (`QuantRows`): the
    (rows, ffn_dim) float hidden is never written nor read back."""
    f1, f2 = ffn.fc1, ffn.fc2
    if ffn.relu and isinstance(f1, Int8Linear) and isinstance(f2, Int8Linear) and f2.fused and f1.runs_int_mm(y):
        return f1.quantized(y, relu=True)
    return hidden_plain(ffn, y)


def attend_sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def encoder_attend_plain(attn, y, heads: int, mask):
    """The encoder's self-attention of y (B, S, d): q, k, v (one product or three), SDPA
    over the heads, merged back to (B, S, d)."""
    return fused.attention_heads(*attn.project_qkv(y), mask, heads)


def encoder_attend_fused(ops, attn, y, heads: int, mask):
    if attn.qkv is None:  # the C++ op reads the one q|k|v product
        return encoder_attend_plain(attn, y, heads, mask)
    return ops.encoder_attention(attn.qkv(y), mask, heads)


class CrossPlain:
    """A batch's cross K/V (B, h, S, hd) as projected, with its padding mask; each step's
    queries q (B, Q, d) (a sentence's beams) through the plan's decode-step attention."""

    def __init__(self, k, v, mask, attend):
        self.k, self.v, self.mask, self.attend = k, v, mask, attend

    def __call__(self, q):
        return fused.merge(self.attend(fused.heads(q, self.k.shape[1]), self.k, self.v, self.mask))

    def keep(self, sents):
        """Only the sentences `sents` stay."""
        self.k, self.v = self.k.index_select(0, sents), self.v.index_select(0, sents)
        self.mask = None if self.mask is None else self.mask.index_select(0, sents)


def cross_fused(ops, bf16: bool = False):
    """The batch's cross K/V in the C++ op's store (`bf16`: rounded to bf16, switch
    cross_bf16); where the ops have none (CUDA, no compiler) the plain store, which keeps
    CUDA's decode_attention kernel."""
    if not ops.is_kernel("cross_store"):
        return CrossPlain
    return lambda k, v, mask, attend: ops.cross_store(k, v, mask, bf16=bf16)


def cross_fused_bf16(ops):
    return cross_fused(ops, bf16=True)


def write_kv_plain(attn, y, kc, vc, t: int):
    """q of y (N, 1, d); k, v written into the cache kc, vc (N, h, T, hd) at position t."""
    q, k, v = attn.project_qkv(y)
    N, h = kc.shape[:2]
    kc[:, :, t] = k.view(N, h, -1)
    vc[:, :, t] = v.view(N, h, -1)
    return q


def write_kv_fused(ops, attn, y, kc, vc, t: int):
    if attn.qkv is None:  # the C++ split needs the one q|k|v product
        return write_kv_plain(attn, y, kc, vc, t)
    return ops.qkv_to_cache_(kc, vc, attn.qkv(y), t)


def normalise_greedy(logits):
    return torch.log_softmax(logits.float(), -1)  # same argmax: the naive baseline pays for it


def identity(x):
    return x


def argmax_torch(logits):
    return logits.argmax(-1)


def topk_split(ops, logits, scores, K: int, n: int):
    """ATen's log-softmax, then one C++ pass for + score and the top n: the plain picks bit for bit."""
    lp = torch.log_softmax(logits.float(), -1)  # (rows, V)
    return ops.log_softmax_topk(lp, scores, K, n, True)


def topk_one_pass(ops, logits, scores, K: int, n: int):
    return ops.log_softmax_topk(logits, scores, K, n)


# -- the registry --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Optimisation:
    name: str
    default: bool
    label: str                # what it does, short: the benchmark row, --help
    slot: str                 # the piece of the Plan it sets
    on: Any                   # the slot's value when switched on
    off: Any                  # ... when off: the reference it replaces (first entry of a slot only)
    replaces: str             # that reference, in words
    bench: str                # where the benchmarks measure it: "ladder" (one cumulative row each, naive
    #                           first), "step" / "greedy" / "beam" (alone against the plain row), "int8",
    #                           "ngram", "cuda", "shortlist" (rows only where that applies),
    #                           "batch1" (the batch-1 group, each off against the best)
    row: dict = field(default_factory=dict)  # other settings its ladder row changes with it
    needs: Callable[[Any], bool] = lambda opts: True  # other settings it only works with
    detail: str = ""          # more for decoder/README.md
    worth: str = ""           # what it measured: device, date, ratio (python -m decoder --list-switches)


OPTIMISATIONS: tuple[Optimisation, ...] = (
    Optimisation("cache", True, "K/V cache, cross K/V once per sentence", "state", "incremental", "recompute",
                 "the whole prefix re-run every step, encoder output copied per beam", "ladder",
                 detail="self-attention K/V in one preallocated buffer written at position t (gpt-fast); the "
                 "beams of a sentence are the query positions of one cross-attention call (FastSeq)"),
    Optimisation("sort", True, "length-sorted batches", "sort", True, False, "batches in input order", "ladder"),
    Optimisation("softmax_free", True, "greedy without softmax", "normalise", identity, normalise_greedy,
                 "log-softmax before the argmax", "ladder", row={"beam": 1}),
    Optimisation("early_stop", True, "early stop (finished sentences leave)", "early_stop", True, False,
                 "every row decoded to the longest limit", "ladder",
                 detail="finished rows leave in groups of `shrink_ratio` (0.25) of the rows: each shrink "
                 "copies the live cache, so shrinking per sentence costs more"),
    Optimisation("fused_qkv", True, "fused QKV", "fused_qkv", True, False,
                 "three products for q, k, v (cross: two for k, v)", "ladder",
                 detail="one product for q|k|v (cross-attention: k|v), concatenated at load time"),
    Optimisation("pipeline", True, "async text pipeline", "pipeline", True, False,
                 "read, encode, translate, decode one after another", "ladder",
                 detail="normalisation + SentencePiece of the next chunk and detokenisation in threads"),
    Optimisation("fast_normaliser", True, "Moses normalisation, rules skipped where they cannot match",
                 "fast_normaliser", True, False, "sacremoses' `normalize`: every rule's `re.sub` on every line",
                 "ladder",
                 detail="decoder/normalise.py: sacremoses' rules compiled once, each run only on a line that "
                 "holds a literal all its matches contain, and looked for only where the line has that "
                 "literal's non-ASCII characters; the same output, 11x faster on 10,000 Bible lines (0.51 to "
                 "0.046 s, EPYC core): a tenth of a GPU throughput pass was normalisation"),
    Optimisation("ramp_chunks", False, "chunks ramping up from 2,048 lines", "ramp_chunks", True, False,
                 "every chunk `chunk_lines` (20,000) lines: the first batch waits for a whole chunk's encoding",
                 "cuda",
                 detail="the first chunk 2,048 lines (`pipeline.RAMP_FIRST`), each next twice the last up to "
                 "`chunk_lines`, so the first batch starts sooner and the next chunk's encoding overlaps the "
                 "decoding; smaller sorting pools at the start. Not measured on a GPU yet"),
    Optimisation("early_start", False, "the first chunk decoded from its longest lines while the rest encode",
                 "early_start", True, False, "the first chunk encoded whole before its first block: the GPU idle "
                 "meanwhile", "cuda", needs=lambda o: o.refill_rows,
                 detail="with refill_rows, a run's first chunk of at least two states' worth of lines "
                 "(`Translator._stage`): its longest lines by characters, a state's rows of them (4,096 at the "
                 "GPU's 64k tokens), are encoded first and decoded at once while a thread encodes the rest, "
                 "which joins the state when encoded (`refill.More`; a sentence longer than the state's sources "
                 "gets a state of its own after). Later chunks are encoded while the one before decodes. The same "
                 "outputs (tests/test_refill.py). Not measured on a GPU yet (`tools.bench_gpu --ablate "
                 "early_start` turns it on)"),
    Optimisation("short_gil_interval", True, "the GPU-feeding thread takes the GIL back within 0.2 ms",
                 "switch_interval", 0.0002, None,
                 "Python's switch interval of 5 ms: the decoding thread waits up to that for the GIL after "
                 "each op and each wait for the GPU while a text thread runs Python", "cuda",
                 detail="while the text pipeline's threads run (decoder/pipeline.py `run`), "
                 "`sys.setswitchinterval(0.0002)`, restored after. The thread that feeds the GPU gives the "
                 "GIL up in every torch call and every wait for the GPU, and a thread running Python (the next "
                 "chunk's normalisation, a batch's detokenisation) hands it back only at its switch interval: "
                 "a loop waiting on the GPU every 2.4 ms beside Text.encode was busy 42% of its time at 5 ms, "
                 "80% at 0.2 ms (`python -m tools.bench_gil`, docs/bench/gil.md). CUDA only: on 2 CPU cores, "
                 "whose steps are long, it measured 0.98x"),
    Optimisation("decode_ahead", True, "the next chunk decoded while this chunk's outputs are handed out",
                 "decode_ahead", True, False, "the decoding waits at every chunk's end while its last batch is "
                 "detokenised and its lines are written", "cuda",
                 detail="decoder/pipeline.py: the decoding runs in a thread of its own, and when a chunk is done "
                 "and the next is already read and encoded (the usual case: the text thread reads ahead), the "
                 "next one's batches start before this one's outputs are collected and handed to the writer; a "
                 "next chunk not yet read (a pipe's writer waiting for its answer) is waited for after the "
                 "outputs are out. Only a run of several chunks (more than `chunk_lines` lines) has chunk ends "
                 "to hide. CUDA only. Not measured on a GPU yet (`tools.bench_gpu --chunked`)"),
    Optimisation("retain_memory", True, "glibc keeps freed memory", "retain_memory", True, False,
                 "glibc's default mmap thresholds (page faults on every large activation)", "ladder",
                 detail="process-wide and irreversible (decoder/runtime.py)"),
    Optimisation("fused_ops", True, "int8 linear as one C++ call", "int8_fused", True, False,
                 "`Int8Linear.reference`: the same math as ~8 tensor ops", "int8",
                 detail="quantise rows, `_int_mm`, rescale, bias and relu in decoder/csrc/int8_linear.cpp"),
    Optimisation("fbgemm_int8", True, "fbgemm prepacked int8 linear", "int8_kernel", "fbgemm", "int_mm",
                 "our `_int_mm` int8 linear (`Int8Linear`; `fused_ops` picks its C++ or tensor-op form)", "int8",
                 needs=lambda o: fbgemm_available(),
                 detail="`quantized::linear_dynamic` on weights packed at load time (u8 x s8: `vpmaddubsw` on "
                 "AVX2, VNNI on AVX-512), for the layer linears, the output projection and the shortlist's "
                 "sliced projection (repacked per batch); `_int_mm` is 13-30x slower than fp32 without VNNI (with VNNI "
                 "`int8_vnni_int_mm` takes it back)"),
    Optimisation("int8_vnni_int_mm", True, "our `_int_mm` int8 linear where it runs VNNI", "int8_kernel", "int_mm",
                 "fbgemm", "fbgemm's linear on VNNI CPUs too", "int8", row={"fbgemm_int8": True, "fused_ops": True},
                 needs=lambda o: int_mm_vnni(),
                 detail="where the CPU has avx512_vnni and neither ATEN_CPU_CAPABILITY nor ONEDNN_MAX_CPU_ISA caps "
                 "it below (`quant.int_mm_vnni`), every int8 linear, the output projection and the shortlist's "
                 "slice included, runs `Int8Linear` above the gemv rows: up to 1.35x fbgemm's speed at the layer "
                 "linears, 1.25x at the projection's >= 64 rows (docs/bench/decoder.md); elsewhere fbgemm stays"),
    Optimisation("int8_packed_gemm", True, "int8 product on weights packed once (C++, VNNI)", "int8_packed_gemm",
                 True, False, "`torch._int_mm` (oneDNN reorders the int8 weights on every call)", "int8",
                 row={"fbgemm_int8": True, "int8_vnni_int_mm": True, "fused_ops": True},
                 needs=lambda o: int_mm_vnni() and o.fused_ops and (o.int8_vnni_int_mm or not o.fbgemm_int8
                                                                    or not fbgemm_available()),
                 detail="`Int8Linear` calls run decoder/csrc/int8_gemm.cpp on weights packed at load time (the "
                 "shortlist's slice: per batch) for `vpdpbusd`, 6 rows x 64 columns a tile, the same integers as "
                 "`_int_mm`; calls of up to 256 rows (`Int8Linear.PACKED_ROWS`: every decode step, not the encoder's "
                 "batches): 1.1-1.9x `_int_mm` at 8-40 rows, 1.03x at 160 on an AVX-512 VNNI EPYC"),
    Optimisation("int8_wide_gemm", False, "exact int16 int8 product where no VNNI (C++, AVX2)", "int8_kernel",
                 "wide", "fbgemm", "fbgemm's linear (7-bit activations without VNNI, the shortlist's slice prepacked "
                 "per batch)", "int8", row={"fbgemm_int8": True, "fused_ops": True},
                 needs=lambda o: o.fused_ops and not int_mm_vnni() and wide_gemm_available(),
                 detail="where `_int_mm` has no VNNI (an AVX2 CPU, or ATEN_CPU_CAPABILITY=avx2) and our kernels run "
                 "AVX2, every `Int8Linear` call above the gemv rows runs decoder/csrc/int8_gemm.cpp on the weights "
                 "widened to int16 at load time (`vpmaddwd`, 2 rows x 4 columns a tile): exactly `_int_mm`'s "
                 "integers, so the VNNI path's output on AVX2; the shortlist's slice a row gather (54x faster than "
                 "fbgemm's repack). Off: 0.72-0.84x fbgemm's speed at 64-160 rows (fbgemm's AVX2 step sums two "
                 "`vpmaddubsw` in saturating int16, more multiply-adds an instruction than any exact step), 0.93x "
                 "decoding the fixture, AVX2-capped EPYC (docs/bench/decoder.md)"),
    Optimisation("int8_wide_output", False, "exact int16 output projection beside fbgemm's layers (C++, AVX2)",
                 "int8_out_kernel", "wide", None, "the layers' int8 linear (fbgemm: the shortlist's slice prepacked "
                 "per batch)", "int8", row={"fbgemm_int8": True, "fused_ops": True},
                 needs=lambda o: (o.fused_ops and o.fbgemm_int8 and o.shortlist and not o.int8_wide_gemm
                                  and not int_mm_vnni() and fbgemm_available() and wide_gemm_available()),
                 detail="where the layers run fbgemm (no VNNI), the output projection alone runs "
                 "decoder/csrc/int8_gemm.cpp on int16-widened weights, so the shortlist's slice is a row gather "
                 "instead of fbgemm's repack of the slice every batch; its logits are `_int_mm`'s integers"),
    Optimisation("int8_gemv", True, "int8 gemv kernel at <= 4 rows (C++)", "int8_gemv_rows", 4, 0,
                 "fbgemm's `quantized::linear_dynamic` (or `_int_mm`) at every row count", "int8",
                 row={"fbgemm_int8": True},
                 detail="calls of 1-4 rows (batch 1, a few live sentences) run decoder/csrc/int8_gemv.cpp: one "
                 "scale per activation row, u8 x s8 dot products per output row (`vpdpbusd` with VNNI, "
                 "`vpmaddubsw` on AVX2, plain C++ elsewhere), no packing; 1.7-3x faster than fbgemm at 1 row "
                 "(docs/bench/decoder.md); the layer linears, the output projection and the shortlist's slice"),
    Optimisation("fused_norm", True, "fused bias+residual+LayerNorm (C++)", "add_norm",
                 with_ops(add_norm_fused, "add_bias_residual_layernorm"),
                 add_norm_plain, "`add_norm_plain`: addmm, add, layer_norm", "step"),
    Optimisation("fused_relu", False, "fused bias+relu (C++)", "hidden",
                 with_ops(hidden_fused, "add_bias_relu"), hidden_plain,
                 "`hidden_plain`: addmm with bias, relu", "step",
                 detail="fp32/bf16 fc1 as a bias-free product, then one C++ pass (int8 has it in its epilogue)"),
    Optimisation("int8_quantized_hidden", True, "int8 fc1 quantises its output for fc2 (C++)", "hidden",
                 hidden_int8, None, "fc1's float output, quantised again by fc2", "int8",
                 needs=lambda o: not o.fused_relu,
                 detail="`_int_mm` layers: each row of relu(fc1) is rescaled into a row buffer and quantised "
                 "there, so the (rows, ffn_dim) float hidden is never written nor read back; the same bits "
                 "(fused_relu, for fp32/bf16, takes the slot when on)"),
    Optimisation("fused_attention", True, "fused decode-step attention (C++)", "attend", op("decode_attention"),
                 attend_sdpa, "`scaled_dot_product_attention`", "step",
                 detail="the cached step's attention for its few queries, reading the cache slice in place"),
    Optimisation("fused_encoder_attention", True, "fused encoder self-attention (C++)", "encoder_attend",
                 with_ops(encoder_attend_fused, "encoder_attention"), encoder_attend_plain,
                 "chunk, head views, `scaled_dot_product_attention`, merge copy", "step",
                 detail="the fused q|k|v product (B, S, 3d) to the merged heads (B, S, d) in one call, its loops "
                 "vectorised over keys and features for many queries, its (row, head) pairs split over the threads"),
    Optimisation("fused_cross_attention", True, "fused cross-attention on K/V arranged per batch (C++)",
                 "cross_kv",
                 Bound(cross_fused, ("cross_store",)), CrossPlain,
                 "`fused_attention`'s attention (or SDPA) on the cross K/V as projected, padding masked", "step",
                 detail="the cross K/V laid out once per batch (per sentence and head: K transposed, padded to "
                 "register blocks, the padding left out); each step a sentence's beams (greedy: its one query) "
                 "run the encoder op's register blocks, FMAs along keys and features with no horizontal sums"),
    Optimisation("cross_bf16", False, "bf16 cross-attention K/V (C++)", "cross_kv",
                 Bound(cross_fused_bf16, ("cross_store",)), None,
                 "fused_cross_attention's fp32 arranged K/V", "greedy", row={"fused_cross_attention": True},
                 needs=lambda o: o.fused_cross_attention,
                 detail="the cross K/V arranged once per batch, then rounded to bf16 (nearest even, as "
                 "`Tensor.to`); each step the kernel widens them to fp32 in registers (a shift, vectorised in "
                 "every ISA variant), arithmetic in fp32: half the bytes the step's cross-attention reads; "
                 "a numeric change"),
    Optimisation("fused_cache", True, "fused q/k/v split into the K/V cache (C++)", "write_kv",
                 with_ops(write_kv_fused, "qkv_to_cache_"),
                 write_kv_plain, "`write_kv_plain`: chunk, two strided cache writes", "step",
                 detail="needs fused_qkv: the one q|k|v product is split by the C++ call"),
    Optimisation("fused_argmax", False, "fused argmax (C++)", "argmax", op("argmax_rows"),
                 argmax_torch,
                 "`Tensor.argmax`", "greedy",
                 detail="where fused_project_argmax does not apply; torch.argmax's rule for ties and NaN"),
    Optimisation("fused_project_argmax", True, "fused output projection + argmax (C++)", "argmax_in_step", True,
                 False, "`F.linear`, then the argmax", "greedy",
                 needs=lambda o: o.softmax_free and not o.no_repeat_ngram,
                 detail="greedy, fp32/bf16 output layer, no n-gram blocking: the projection 1024 vocabulary "
                 "rows at a time with a running best per row; the logits are never written (below 8 rows: one "
                 "product and the C++ argmax)"),
    Optimisation("fused_topk", True, "fused add+top-k (C++)", "topk",
                 with_ops(topk_split, "log_softmax_topk"), None,
                 "log-softmax, add, `Tensor.topk`", "beam",
                 detail="after ATen's log-softmax one C++ pass adds the beam scores and finds the top 2k without "
                 "writing the sums: the plain path's picks bit for bit (steps forcing </s> take the plain path)"),
    Optimisation("fused_log_softmax", True, "fused log-softmax+top-k (C++)", "topk",
                 with_ops(topk_one_pass, "log_softmax_topk"), None,
                 "fused_topk with ATen's log-softmax", "beam", needs=lambda o: o.fused_topk,
                 detail="the log-probabilities are never written: 1.03x at int8 beam 4 on the KD student, no line "
                 "changed of 1,003; they round differently from ATen's, so near ties may flip (one line in 300 "
                 "in fp32 on an AVX-512 EPYC)"),
    Optimisation("fused_project_topk", True, "fused output projection + log-softmax + top-k (C++)", "project_topk",
                 True, False, "the projection's (rows x C) logits written, then the plan's log-softmax + top-k", "beam",
                 needs=lambda o: not o.no_repeat_ngram and o.int8_packed_gemm and BY_NAME["int8_packed_gemm"].needs(o),
                 detail="beam, an int8 output layer on the packed VNNI product (int8_packed_gemm; the shortlist's "
                 "slice too), no n-gram blocking (it needs the whole row): decoder/csrc/project_topk.cpp takes the "
                 "product 128 columns at a time while they are in cache and keeps per row a running max and sum of "
                 "exps and its 2k best logits; each sentence gets its 2k best log-prob + score, the int32 and float "
                 "logits never written. Steps that force </s>, fbgemm, fp32 and the gemv kernel's few rows take the "
                 "plain path. On: 1.05x the shipped beam 4 on the KD student (2 workers, shortlist, AVX-512 VNNI "
                 "EPYC, the same tokens; docs/bench/decoder.md), where alone one step is 1.00x at 160 rows x 4,000 "
                 "columns at d 256, 1.24x over 8,000 and 0.81x over 2,000 at d 128 (the trained fixture: 0.92x): "
                 "each beam row keeps its own 2k best where the plain path's sentence-wide bar skips most of the "
                 "other beams' columns, so it pays at student sizes, not at d 128"),
    Optimisation("kv_row_table", True, "beam reorder through a row table", "kv_row_table", True, False,
                 "the live K/V cache copied to its new rows at every beam step (on a GPU the whole fixed-shape "
                 "buffer: read and written twice a step)", "beam",
                 needs=lambda o: o.fused_attention and o.cache,
                 detail="decoder/cache.py RowTableCache (CPU) and StaticCache (the CUDA graphs' state, with "
                 "graph_attention): a reorder rewrites a (rows, T) table of cache rows, the attention kernel reads "
                 "key j of row b from row table[b, j] (decode_attention_rows; on CUDA the block, warp and 16-byte "
                 "kernels, each table entry clamped into the cache). On where the device's kernels are loaded; "
                 "on CUDA its self-check refuses it alone (`fused.OWN_FALLBACK`). On a GPU not measured yet "
                 "(`tools.bench_gpu --ablate kv_row_table`, the beam rows)"),
    Optimisation("kv_half", False, "fp16 self-attention K/V cache", "kv_half", True, False,
                 "the fp32 K/V cache", "beam", needs=lambda o: o.fused_attention and o.cache,
                 detail="an fp32 (or int8) model's batch caches (greedy and beam, IncrementalCache and "
                 "RowTableCache; not the one-row state) store the self-attention keys and values in fp16 "
                 "(rounded as `Tensor.to`), the C++ cache write and attention convert with F16C: half the "
                 "bytes of the step's bandwidth-bound attention; a numeric change"),
    Optimisation("fused_ngram", True, "n-gram blocking in C++", "block", op("ngram_block_"),
                 fused.ngram_block_reference, "`ngram_block_reference` (Python loop)", "ngram",
                 detail="with --no-repeat-ngram N"),
    Optimisation("cuda_graphs", True, "CUDA graphs", "cuda_graphs", True, False, "eager steps", "cuda",
                 detail="fixed-shape steps (decoder/cache.py StaticCache) replayed from one captured graph"),
    Optimisation("graph_reuse", True, "CUDA graphs kept per batch shape", "static_keep", 64, 0,
                 "a graph captured (and its state built) for every batch", "cuda",
                 detail="the fixed-shape state of a batch of at most 16 rows is kept, 64 shapes at most, and a "
                 "later batch of the same rows, source length, beam and cache length reloads it in place and "
                 "replays its graph: no capture, warm-up steps or graph memory per sentence at batch 1"),
    Optimisation("graph_steps", True, "whole search steps, bookkeeping included, in CUDA graphs", "graph_steps",
                 True, False, "one graph for the decoder's step; the search's projection, argmax or top-k and "
                 "bookkeeping as ~14 (greedy) or ~35 (beam) launches a step", "cuda",
                 needs=lambda o: not o.shortlist and not o.no_repeat_ngram,
                 detail="on the fixed-shape state without shortlist or n-gram blocking (decoder/static_steps.py): "
                 "the whole step (decoder, projection, argmax or top-k, forced </s>, finished rows and "
                 "hypotheses, histories, beam reorder, the position advanced on the device) at fixed "
                 "addresses; greedy: `sync_every` steps one graph, the done mask read once per replay; beam: "
                 "one step a graph"),
    Optimisation("refill_rows", True, "finished greedy rows refilled with the chunk's next sentences",
                 "refill_rows", True, False, "each batch decoded until its longest output ends, its finished rows "
                 "fed <pad>", "cuda", needs=lambda o: o.graph_steps,
                 detail="with graph_steps, greedy (decoder/refill.py): a chunk's sentences stream through one "
                 "fixed-shape state of max_tokens/16 rows (4,096 on a GPU), each row at its own position; every "
                 "`sync_every` steps the finished rows' outputs leave and the next sentences, encoded ahead in "
                 "the usual batches, take their rows. One graph a chunk; the steps are as many as the chunk's "
                 "tokens need at that width (the Bible's 10,000 lines: 160 against 504 at 64k-token "
                 "batches, half of whose rows' steps fed <pad>). Not measured on a GPU yet"),
    Optimisation("refill_on_device", False, "finished greedy rows refilled on the device, step by step",
                 "refill_on_device", True, False, "rows refilled by the host after it reads them finished: "
                 "idle from their </s> to the block after next", "cuda", needs=lambda o: o.refill_rows,
                 detail="with refill_rows (decoder/refill_device.py): a ring of encoded sentences waits on the "
                 "device, and at the end of every step the finished rows take its next ones (at most an eighth "
                 "of the rows a step) in fixed-shape ops the block's graph holds; each sentence writes to an "
                 "output slot of its own. The host reads the finished slots and tops the ring up once a block. "
                 "The same outputs (tests/test_refill_device.py). Not measured on a GPU yet"),
    Optimisation("narrow_tail", True, "a refilled state's busy rows moved to one of half its rows once no "
                 "sentence waits", "narrow_tail", True, False, "the state's every row run to its last sentence's "
                 "end, most of them finished", "cuda", needs=lambda o: o.refill_rows and not o.refill_on_device,
                 detail="with refill_rows (decoder/static_steps.py `narrow_to`): once the chunk's last sentences have "
                 "rows and at most half of the state's rows are busy, those rows (their K/V so far, cross K/V, "
                 "positions, outputs) move to a state of half the rows, or a quarter, ..., not below 256, "
                 "behind the block the GPU is running, and its graph is captured ahead. The Bible's 10,000 lines "
                 "at 8,192 rows (the GPU's 128k tokens): 1,048,576 row-steps in 128 steps, against 690,488 in 304 "
                 "for a state per batch; narrowed, 509,952 in 128 (4,096 rows: 589,824 to 456,704; "
                 "`python -m tools.decode_steps`, docs/bench/decode-steps.md). The same outputs "
                 "(tests/test_refill.py). Not measured on a GPU yet"),
    Optimisation("narrow_beam", True, "a fixed-shape beam state's unfinished sentences moved to a state of "
                 "their own once they hold at most half its rows", "narrow_beam", True, False, "every sentence's "
                 "beams run to the batch's last sentence's end: about half the row-steps finished sentences'",
                 "beam",
                 needs=lambda o: o.graph_steps,
                 detail="with graph_steps, beam (decoder/static_steps.py `narrow_to`): at a read of the finished "
                 "sentences, a state of at least 512 rows whose unfinished sentences hold at most half of them "
                 "moves those (their K/V so far, row table, cross K/V, scores, histories, caps) to a state of "
                 "their own, whose graphs are captured anew; the finished hypotheses stay where they are. The "
                 "GPU bench's 1,000 beam lines, KD student: 238,176 row-steps in 184 steps at the GPU's beam "
                 "batches (16k tokens), narrowed 148,000 in the same steps (64k tokens: 265,920 to 151,744), "
                 "the same outputs (`python -m tools.decode_steps --beam 4`, docs/bench/decode-steps.md; "
                 "tests/test_beam_cache.py). Not measured on a GPU yet"),
    Optimisation("normalise_processes", True, "a chunk's Moses normalisation in worker processes",
                 "normalise_processes", True, False, "normalised in the text pipeline's thread, which holds the GIL "
                 "meanwhile", "cuda", needs=lambda o: o.fast_normaliser,
                 detail="decoder/pipeline.py NormalisePool: the fast normaliser (pure Python, ~4.5 us a line) in "
                 "half the machine's cores' processes, at most 8 and none below 4 cores, each on a share of the "
                 "chunk's lines; the workers import neither torch nor the model. The first chunk's normalisation "
                 "is on the wall before any decoding, and a later chunk's took the GIL from the thread that feeds "
                 "the GPU. CUDA only (a CPU's cores decode). Not measured on a GPU yet"),
    Optimisation("encode_ahead", True, "the next batch encoded before this one's search", "encode_ahead", True,
                 False, "each batch's inputs copied and encoded after the last batch's search has ended", "cuda",
                 detail="Translator.each_batch: batch k+1's padding, copy to the GPU, encoder (and shortlist) are "
                 "queued before batch k's search starts, so when k's last read returns the GPU already has k+1's "
                 "encoder output and the host goes straight to its search; one more batch's encoder output "
                 "held. CUDA only (a CPU runs the same work in the same order either way). Not measured on a "
                 "GPU yet"),
    Optimisation("capture_ahead", True, "the greedy block's graph captured while the GPU runs the warm-up",
                 "capture_ahead", True, False, "captured at the second block, after the host's read of the first "
                 "has waited for the GPU: the GPU idle while the host captures", "cuda",
                 needs=lambda o: o.graph_steps,
                 detail="with graph_steps, greedy: a batch's first block of steps runs eagerly (the warm-up), then "
                 "its graph is captured at once, before the read of the first block's finished rows, so the "
                 "host's capture (a few ms for 8 steps) overlaps the GPU's encoder and warm-up; a batch whose "
                 "cap allows one block only captures nothing. Not measured on a GPU yet"),
    Optimisation("graph_attention", True, "decode-step attention kernel in the fixed-shape state",
                 "static_attend", True, False, "`scaled_dot_product_attention` over the whole cache with a -inf "
                 "bias past the position (cuDNN's flash attention on a GPU: a third of the H100's GPU time)", "cuda",
                 needs=lambda o: o.fused_attention,
                 detail="the CUDA graphs' state (decoder/cache.py StaticCache) attends through the plan's "
                 "decode-step attention kernel (fused_attention: one block per row, head and query), masked by a "
                 "bool mask past each row's position, for self- and cross-attention: it reads only the keys and "
                 "values written so far and each row's own source, where SDPA reads the whole buffers (with "
                 "refill_rows, every row over the chunk's longest source and cap: about 8x the bytes on the "
                 "Bible's 10,000 lines). On where the CUDA kernels are loaded. H200, the per-batch loop "
                 "without graphs: 1.05x throughput, 0.97x at batch 1 (one pass each); with refill_rows not "
                 "measured on a GPU yet (`tools.bench_gpu --ablate graph_attention` measures it off)"),
    Optimisation("warp_attention", True, "decode-step attention a warp per row and head (CUDA)", "attend",
                 op("decode_attention_warp"), None, "the CUDA kernel's block of 256 threads per row and head: a "
                 "thread per key, reading its key with a stride, and a quarter of the threads over the features",
                 "cuda",
                 needs=lambda o: o.fused_attention,
                 detail="csrc/fused_cuda.cu `decode_attention_warp_kernel`: four (row, head) pairs a block of 128 "
                 "threads, the 32 lanes of a warp splitting each key's dot product and the output's features (rows "
                 "of K and V read whole, reductions by shuffles, no block barrier, keys in tiles of 8 whose loads "
                 "go out together; where a head's rows are 16-byte aligned, as the decoder's 64 fp16 features are, "
                 "`decode_attention_wide_kernel`: 16-byte loads, eight lanes a key, four keys at once), for self- and cross-attention wherever the plan's attention runs the CUDA "
                 "kernel; the block kernel past 128 features or 3,072 keys, and under 16 (row, head) pairs per "
                 "multiprocessor (`fused.WARP_MIN_PER_SM`: batch 1, where a warp walking its keys is slower than "
                 "a block spreading them; estimated, not measured). Its self-check refuses it alone "
                 "(`fused.OWN_FALLBACK`): the block kernel then runs. "
                 "With refill_rows a step attends for thousands of rows, where the block kernel's 256-thread "
                 "blocks queue in waves. Not measured on a GPU yet (`tools.bench_gpu --ablate warp_attention`)"),
    Optimisation("one_row", True, "one-row greedy loop (latency)", "one_row", True, False,
                 "the batch loop at one row: tensor bookkeeping, `emb[ids]`, a padding mask", "batch1",
                 detail="one sentence, greedy (decoder/cache.py OneRowCache, decoder/search.py `greedy_one`): "
                 "token and output as Python ints (no where/cat/any per step), the embedding one row looked up, "
                 "cross-attention without a padding mask (one sentence has none), the forced last </s> not run"),
    Optimisation("one_row_attention", True, "one-row attention (C++)", "attend_one", op("decode_attention"),
                 attend_sdpa, "`scaled_dot_product_attention` at one row", "batch1",
                 detail="with one_row: the C++ decode attention for the one query (its set-up is a third of "
                 "SDPA's at one row); fused_attention is the same kernel for batches"),
    Optimisation("one_row_cache", True, "one-row q/k/v split into the K/V cache (C++)", "write_kv_one",
                 with_ops(write_kv_fused, "qkv_to_cache_"), write_kv_plain, "`write_kv_plain` at one row", "batch1",
                 detail="with one_row: fused_cache's kernel for the one row (29 against 36 us with the fp32 "
                 "q|k|v product on an AVX-512 EPYC)"),
    Optimisation("one_row_layer", True, "one-row decoder layer in one C++ call", "one_row_layer", True, False,
                 "the layer's ~25 ops at one row (gemv products, cache write, attention, norms)", "batch1",
                 row={"fused_norm": True}, needs=lambda o: o.one_row and o.fused_norm and o.fused_qkv,
                 detail="with one_row, int8 and int8_gemv: decoder/csrc/fused_cpu.cpp `one_row_layer` runs a whole "
                 "decoder layer (q|k|v, cache write, self- and cross-attention, FFN, residual LayerNorms) with the "
                 "gemv kernel's products, the math of the fused_norm path bit for bit"),
    Optimisation("one_row_step", True, "one-row decode step in one C++ call", "one_row_step", True, False,
                 "one_row_layer per layer, with the embedding, first norm, output projection and argmax "
                 "as ~10 tensor ops around them", "batch1",
                 row={"one_row_layer": True, "fused_norm": True},
                 needs=lambda o: o.one_row_layer and o.one_row and o.fused_norm and o.fused_qkv
                 and o.fused_project_argmax and o.softmax_free and not o.no_repeat_ngram,
                 detail="with one_row_layer, greedy without n-gram blocking, an int8 gemv output layer: "
                 "decoder/csrc/fused_cpu.cpp `one_row_step` looks up the token's embedding and position, runs "
                 "the first norm (ATen's layer_norm), every layer as one_row_layer, the output projection "
                 "(gemv, full or the shortlist's rows) and the argmax, and returns the column: one dispatch a "
                 "step"),
    Optimisation("shortlist", False, "lexical shortlist", "shortlist", True, False, "the full vocabulary",
                 "shortlist", detail="the output layer over the batch's candidates from the model dir's "
                 "shortlist.safetensors (python -m student.shortlist)"),
)
BY_NAME = {o.name: o for o in OPTIMISATIONS}

def group(bench: str) -> list[Optimisation]:
    return [o for o in OPTIMISATIONS if o.bench == bench]

Switches = dataclasses.make_dataclass(
    "Switches", [(o.name, bool, field(default=o.default)) for o in OPTIMISATIONS], frozen=True)
Switches.__doc__ = "One bool per entry of OPTIMISATIONS (decoder/optimisations.py)."


def all_off() -> dict:
    """Every switch off: the naive configuration the benchmarks start from."""
    return {o.name: False for o in OPTIMISATIONS}


def defaults() -> dict:
    """Every switch at its default: the decoder as shipped."""
    return {o.name: o.default for o in OPTIMISATIONS}


def kernels_off() -> dict:
    """Every fused C++ kernel of the search and the step off, whatever the defaults:
    the benchmarks' plain rows."""
    return {o.name: False for b in ("step", "greedy", "beam") for o in group(b)}


def describe(kw: dict) -> str:
    """Short name of a configuration: its precision and the kernels switched on."""
    parts = [kw.get("precision", "fp32")]
    parts += [o.label.replace(" (C++)", "") for b in ("step", "greedy") for o in group(b) if kw.get(o.name)]
    return ", ".join(parts)


@dataclass(frozen=True)
class Plan:
    """What the decoder runs, resolved once from the switches."""
    state: str                  # "recompute" | "incremental" | "row_table" | "static" (decoder/cache.py)
    sort: bool
    normalise: Callable         # greedy: logits -> what the argmax runs on
    early_stop: bool
    fused_qkv: bool
    pipeline: bool
    fast_normaliser: bool       # decoder/normalise.py in place of sacremoses' normalize (same output)
    ramp_chunks: bool           # the text pipeline's chunks ramp up from pipeline.RAMP_FIRST lines
    early_start: bool           # refill_rows: the first chunk decoded from its longest lines while the rest encode
    switch_interval: float | None  # sys.setswitchinterval while the text pipeline's threads run (None: Python's)
    decode_ahead: bool          # the text pipeline decodes the next chunk while this one's outputs go out
    retain_memory: bool
    int8_fused: bool
    int8_kernel: str            # "fbgemm" | "int_mm" | "wide": the int8 linear (decoder/quant.py)
    int8_packed_gemm: bool      # Int8Linear: our packed VNNI product in place of _int_mm (int8_gemm.cpp)
    int8_out_kernel: str | None  # "wide": the int8 output projection's own kernel; None: the layers' (int8_kernel)
    int8_gemv_rows: int         # int8 calls of at most this many rows run our gemv kernel (0: none)
    add_norm: Callable          # (x, lin, inp, norm) -> (x + lin(inp), norm(...))
    hidden: Callable            # (ffn, y) -> act(fc1(y))
    attend: Callable            # decode-step attention (q, k, v, mask=None)
    write_kv: Callable          # (attn, y, kc, vc, t) -> q; k, v written at t
    cross_kv: Callable          # (k, v, mask, attend) -> a batch's cross K/V, kv(q (B, Q, d)) -> (B, Q, d)
    encoder_attend: Callable    # encoder self-attention (attn, y, heads, mask) -> (B, S, d)
    argmax: Callable            # greedy: (rows, C) -> (rows,)
    argmax_in_step: bool        # greedy: the state returns argmax columns itself
    topk: Callable | None       # beam: (logits, scores, K, n) -> top n; None = plain add + topk
    project_topk: bool          # beam: the state takes the top n from the projection's tiles (DecoderState.step_topk)
    block: Callable             # n-gram blocking, in place
    cuda_graphs: bool           # CUDA only: the static state's steps replayed from one graph
    static_keep: int            # static states kept for reuse by batch shape (0: none; decoder/cache.py)
    graph_steps: bool           # static state: whole search steps in graphs (decoder/static_steps.py)
    capture_ahead: bool         # graph_steps, greedy: the block's graph captured before the first read
    refill_rows: bool           # graph_steps, greedy: a chunk's sentences through one state, rows refilled
    refill_on_device: bool      # refill_rows: the rows refilled on the device each step (decoder/refill_device.py)
    narrow_tail: bool           # refill_rows, the host's: busy rows move to a narrower state once none wait
    narrow_beam: bool           # graph_steps, beam: unfinished sentences move to a narrower state
    encode_ahead: bool          # the next batch's inputs and encoder queued before this batch's search
    normalise_processes: bool   # the text pipeline's normaliser in worker processes (pipeline.NormalisePool)
    static_attend: bool         # static state: its attention through `attend` (a bool mask) in place of SDPA
    one_row: bool               # batches of one sentence, greedy: the one-row loop and state
    attend_one: Callable        # the one-row state's attention (q, k, v)
    write_kv_one: Callable      # the one-row state's write_kv
    shortlist: bool
    kv_row_table: bool          # beam: reorders rewrite a row table, the K/V cache stays (RowTableCache)
    kv_half: bool               # batch caches: an fp32 model's self-attention K/V cache in fp16
    one_row_layer: bool         # one-row state: each decoder layer one C++ call (int8 gemv models)
    one_row_step: bool          # one-row state, greedy: the whole step one C++ call, the argmax column back
    # resolved from the device, the beam and the kernels loaded, not slots of a switch:
    device: str = "cpu"         # "cpu" | "cuda"
    loop: str = "greedy"        # "greedy" | "beam" (batches of one sentence: `one_row` above)
    sync_every: int = 1         # the loop reads its finished rows to the host every this many steps
    kernels: bool = False       # the device's fused kernels are loaded (C++ on CPU; CUDA: built and self-checked)
    runs: frozenset = frozenset()  # the switches that resolved on
    ops: fused.Ops = fused.REFERENCE  # the fused ops bound for the device and precision (Model.project_argmax)
    bound: tuple = ()           # (slot, whether its fused ops run kernels) for each such slot this loop calls

    def state_for(self, sentences: int) -> str:
        """The decoder cache of a batch (decoder/cache.py CACHES): `state`, or the
        one-row latency state for one sentence, greedy."""
        return "one_row" if self.one_row and sentences == 1 else self.state

    def summary(self, precision: str = "fp32") -> str:
        """The plan in one clause of the settings line: loop, state, graphs, host
        reads, the switches of this device and loop that differ from their defaults,
        and which of the fused ops it calls run kernels (`ops_summary`)."""
        relevant = {"ladder", "step", "shortlist", self.loop, "batch1" if self.loop == "greedy" else "beam",
                    "int8" if precision == "int8" else "", self.device}
        diff = [("" if o.name in self.runs else "no ") + o.name for o in OPTIMISATIONS
                if o.bench in relevant and (o.name in self.runs) != o.default and o.name != "cuda_graphs"]
        reads = "every step" if self.sync_every == 1 else f"every {self.sync_every} steps"
        return (f"{self.loop} loop, {self.state} state" + (", one-row state at 1 sentence" if self.one_row else "")
                + f", CUDA graphs {'on' if self.cuda_graphs else 'off'}"
                + (f", whole {self.loop} steps {self.sync_every if self.loop == 'greedy' else 1} a graph"
                   if self.graph_steps else "") + (", rows refilled" if self.refill_rows else "")
                + f", host reads {reads}"
                + (f"; {' '.join(diff)}" if diff else "") + self.ops_summary())

    def ops_summary(self) -> str:
        """'; kernels: add_norm, attend, ...; reference: ...': which of the slots this
        loop calls that call fused ops run kernels, and which run the PyTorch reference."""
        kernels = [slot for slot, kernel in self.bound if kernel]
        reference = [slot for slot, kernel in self.bound if not kernel]
        return (f"; kernels: {', '.join(kernels) or 'none'}"
                + (f"; reference: {', '.join(reference)}" if reference else ""))


@dataclass(frozen=True)
class Kernels:
    """What is loaded: the inputs `resolve` decides the device's kernels from."""
    cpu: bool   # the C++ ops (decoder/csrc, decoder/ops.py)
    cuda: bool  # the CUDA kernels, built and agreeing with their references
    cuda_refused: frozenset = frozenset()  # of those, kernels refused alone (fused.OWN_FALLBACK)


def loaded_kernels(device: str) -> Kernels:
    """The kernels this process has (builds them on first use; CUDA only for a CUDA device)."""
    from . import ops
    cuda = device == "cuda" and fused._cuda_kernels()
    return Kernels(ops.available(), cuda, fused.cuda_refused_alone() if cuda else frozenset())


# switches whose kernels exist for the CPU only: a CUDA plan never holds them
CPU_ONLY = frozenset({"fused_encoder_attention", "fused_cross_attention", "cross_bf16", "kv_half",
                      "one_row_layer", "one_row_step", "fused_project_topk"})
# of those, the ones whose off path is the same math where the C++ ops are not loaded
SAME_WITHOUT_OPS = frozenset({"fused_encoder_attention", "fused_cross_attention", "cross_bf16", "one_row_layer",
                              "one_row_step", "fused_project_topk"})
# switches that a CPU gains nothing from (or has no such thing): a CPU plan never holds them
CUDA_ONLY = frozenset({"cuda_graphs", "short_gil_interval", "encode_ahead", "decode_ahead", "normalise_processes",
                       "warp_attention"})
# switches whose off path beats their ops' PyTorch reference: on only where the device's kernels are loaded
WITH_KERNELS = frozenset({"kv_row_table"})
# switches whose CUDA kernel is one of its own, which its self-check may refuse alone (fused.OWN_FALLBACK)
OWN_KERNEL = {"warp_attention": "decode_attention_warp", "kv_row_table": "decode_attention_rows"}
# host reads of the finished rows: every step on CPU (a read is a memory access there, and the
# per-step loops are the measured fastest); on CUDA a read stops the host until the GPU catches up
SYNC_EVERY = {"cpu": 1, "cuda": 8}


def _allowed(name: str, device: str, k: Kernels) -> bool:
    kernel = OWN_KERNEL.get(name)
    if device == "cuda" and kernel is not None and not (k.cuda and kernel not in k.cuda_refused):
        return False
    if name in CUDA_ONLY:
        return device == "cuda"
    if name in CPU_ONLY:
        return device == "cpu" and (k.cpu or name not in SAME_WITHOUT_OPS)
    if name in WITH_KERNELS:
        return k.cuda if device == "cuda" else k.cpu
    return True


def resolve(switches, *, device: str = "cpu", beam: int = 1, no_repeat_ngram: int = 0,
            kernels: Kernels | None = None, static_shapes: bool = False, sync_every: int | None = None,
            precision: str = "fp32") -> Plan:
    """The Plan for `switches` (a Switches) on `device` ("cpu" | "cuda"), with
    `kernels` loaded (None: what this process has), at `beam` and `precision`: what
    the step calls (the fused ops bound to their kernels or references) and which
    loop and state run, decided once. `no_repeat_ngram` decides, with the other
    switches, each entry's `needs`.
    `static_shapes`: the fixed-shape state without graphs on any device;
    `sync_every`: host reads every this many steps (None: the device's)."""
    device = "cuda" if device.startswith("cuda") else "cpu"
    k = loaded_kernels(device) if kernels is None else kernels
    view = SimpleNamespace(**dataclasses.asdict(switches), no_repeat_ngram=no_repeat_ngram)
    slots: dict = {}
    runs = set()
    for o in OPTIMISATIONS:
        slots.setdefault(o.slot, o.off)
        if getattr(switches, o.name) and o.needs(view) and _allowed(o.name, device, k):
            slots[o.slot] = o.on
            runs.add(o.name)
    loop = "beam" if beam > 1 else "greedy"
    if slots["state"] == "incremental":
        if slots["cuda_graphs"] or static_shapes:
            slots["state"] = "static"
        elif loop == "beam" and slots["kv_row_table"] and device == "cpu":
            slots["state"] = "row_table"
    slots["one_row"] = slots["one_row"] and slots["state"] == "incremental" and loop == "greedy"
    if slots["state"] != "static":
        slots["static_keep"], slots["static_attend"] = 0, False
        runs -= {"graph_reuse", "graph_attention"}
    if device == "cuda" and not k.cuda:  # its reference reads the whole cache as SDPA does, in more kernels
        slots["static_attend"] = False
        runs.discard("graph_attention")
    # the row table: the CPU's row_table state, or the fixed-shape state through the attention kernel
    # (SDPA reads no table); on CUDA only the graphs' state (the eager one moves just the live K/V)
    sdpa = slots["state"] == "static" and not slots["static_attend"]
    if sdpa or (device == "cuda" and slots["state"] != "static"):
        slots["kv_row_table"] = False
        runs.discard("kv_row_table")
    if slots["state"] != "static" or (loop == "beam" and slots["project_topk"]):
        # the fixed-address beam step takes its top-k from the logits
        slots["graph_steps"] = slots["capture_ahead"] = False
        runs -= {"graph_steps", "capture_ahead"}
    if not slots["graph_steps"] or loop != "greedy":
        slots["refill_rows"] = False
        runs.discard("refill_rows")
    if not slots["graph_steps"] or loop != "beam":
        slots["narrow_beam"] = False
        runs.discard("narrow_beam")
    if not slots["refill_rows"]:
        slots["early_start"] = slots["refill_on_device"] = slots["narrow_tail"] = False
        runs -= {"early_start", "refill_on_device", "narrow_tail"}
    loaded = k.cuda if device == "cuda" else k.cpu
    # the step's tensors are the precision's activations or fp32 (log-softmax): one dtype decides
    ops = fused.bound(device, DTYPES[precision], loaded)
    bound = bind(slots, ops, step_slots(slots, loop, no_repeat_ngram))
    return Plan(**slots, device=device, loop=loop, sync_every=sync_every or SYNC_EVERY[device],
                kernels=loaded, runs=frozenset(runs), ops=ops, bound=bound)


def bind(slots: dict, ops: fused.Ops, calls: set) -> tuple:
    """Every slot value that calls fused ops (`Bound`) bound to `ops`, in place; ->
    (slot, whether its ops run kernels) for those of them that the step `calls`."""
    bound = []
    for slot, value in slots.items():
        if isinstance(value, Bound):
            slots[slot] = value.bind(ops)
            uses = value.uses
        elif slot == "argmax_in_step":  # Model.project_argmax: linear_argmax, or argmax_rows below its rows
            uses = ("linear_argmax", "argmax_rows")
        elif slot == "shortlist":  # the Translator hands its Shortlist ops.shortlist_candidates
            uses = ("shortlist_candidates",)
        else:
            continue
        if slot in calls:
            bound.append((slot, all(ops.is_kernel(name) for name in uses)))
    return tuple(bound)


def step_slots(slots: dict, loop: str, no_repeat_ngram: int) -> set:
    """The slots that a decode with these resolved `slots` calls: the static state
    attends with SDPA itself (unless static_attend), the recompute state through the whole prefix."""
    calls = {"add_norm", "hidden", "encoder_attend"}
    if slots["state"] in ("incremental", "row_table"):
        calls |= {"attend", "write_kv", "cross_kv"}
    if slots["static_attend"]:
        calls.add("attend")
    if slots["one_row"]:
        calls |= {"attend_one", "write_kv_one"}
    if loop == "beam":
        calls.add("topk")
    else:
        calls.add("argmax_in_step" if slots["argmax_in_step"] else "argmax")
    return calls | ({"block"} if no_repeat_ngram else set()) | ({"shortlist"} if slots["shortlist"] else set())


def table_markdown() -> str:
    """decoder/README.md's switch table."""
    rows = ["| switch | default | what it does | replaces |", "|---|---|---|---|"]
    rows += [f"| `{o.name}` | {'on' if o.default else 'off'} | {o.label}{': ' + o.detail if o.detail else ''} "
             f"| {o.replaces} |" for o in OPTIMISATIONS]
    return "\n".join(rows)
