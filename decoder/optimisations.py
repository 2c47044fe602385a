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

from . import fused, search
from .quant import DTYPES, Int8Linear, fbgemm_available, int_mm_vnni


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


def cross_fused(ops):
    """The batch's cross K/V in the C++ op's store; where the ops have none (CUDA, no
    compiler) the plain store, which keeps CUDA's decode_attention kernel."""
    if not ops.is_kernel("cross_store"):
        return CrossPlain
    return lambda k, v, mask, attend: ops.cross_store(k, v, mask)


def normalise_greedy(logits):
    return torch.log_softmax(logits.float(), -1)  # same argmax: the naive baseline pays for it


def identity(x):
    return x


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
    worth: str = ""           # its latest measurement: ratio on/off, group, machine, date


OPTIMISATIONS: tuple[Optimisation, ...] = (
    Optimisation("sort", True, "length-sorted batches", "sort", True, False, "batches in input order", "ladder",
                 worth="int8 as shipped, greedy/beam 4: 1.54x/1.31x EPYC AVX-512 VNNI, 1.54x/1.26x AVX2, 2026-11-29"),
    Optimisation("softmax_free", True, "greedy without softmax", "normalise", identity, normalise_greedy,
                 "log-softmax before the argmax", "ladder", row={"beam": 1},
                 worth="1.11x greedy int8 (with fused_project_argmax: it needs it), EPYC VNNI, 2026-11-29; AVX2 1.07x"),
    Optimisation("early_stop", True, "early stop (finished sentences leave)", "early_stop", True, False,
                 "every row decoded to the longest limit", "ladder",
                 worth="int8 as shipped, greedy/beam 4: 1.17x/1.11x EPYC AVX-512 VNNI, 1.15x/1.16x AVX2, 2026-11-29"),
    Optimisation("fused_qkv", True, "fused QKV", "fused_qkv", True, False,
                 "three products for q, k, v (cross: two for k, v)", "ladder",
                 worth="1.06x greedy int8, EPYC VNNI, 2026-11-29 (beam 4 0.99x; AVX2 1.01x/1.00x); fp32 1.16x"),
    Optimisation("pipeline", True, "async text pipeline", "pipeline", True, False,
                 "read, encode, translate, decode one after another", "ladder",
                 worth="1.02x/1.00x int8 greedy, 25k lines, EPYC VNNI, 2026-11-29 (CPU: noise); GPU not measured"),
    Optimisation("fast_normaliser", True, "Moses normalisation, rules skipped where they cannot match",
                 "fast_normaliser", True, False, "sacremoses' `normalize`: every rule's `re.sub` on every line",
                 "ladder",
                 worth="2.08x throughput (off 0.48x), 1.05x batch 1, H200, 2026-11-26; normaliser 11x on EPYC"),
    Optimisation("short_gil_interval", True, "the GPU-feeding thread takes the GIL back within 0.2 ms",
                 "switch_interval", 0.0002, None,
                 "Python's switch interval of 5 ms: the decoding thread waits up to that for the GIL after "
                 "each op and each wait for the GPU while a text thread runs Python", "cuda",
                 worth="GPU not measured; GIL micro-bench feeder busy 35%->85%, EPYC, 2026-11-26; CPU 0.98x"),
    Optimisation("decode_ahead", True, "the next chunk decoded while this chunk's outputs are handed out",
                 "decode_ahead", True, False, "the decoding waits at every chunk's end while its last batch is "
                 "detokenised and its lines are written", "cuda",
                 worth="GPU not measured (CUDA only)"),
    Optimisation("retain_memory", True, "glibc keeps freed memory", "retain_memory", True, False,
                 "glibc's default mmap thresholds (page faults on every large activation)", "ladder",
                 worth="1.18x greedy int8 as shipped, EPYC AVX-512 VNNI, 2026-11-29 (beam 4 0.99x; AVX2 1.01x/0.97x)"),
    Optimisation("fused_ops", True, "int8 linear as one C++ call", "int8_fused", True, False,
                 "`Int8Linear.reference`: the same math as ~8 tensor ops", "int8",
                 worth="int8 as shipped, greedy/beam 4: 1.36x/1.22x EPYC VNNI, 2026-11-29 (AVX2 runs fbgemm: n/a)"),
    Optimisation("fbgemm_int8", True, "fbgemm prepacked int8 linear", "int8_kernel", "fbgemm", "int_mm",
                 "our `_int_mm` int8 linear (`Int8Linear`; `fused_ops` picks its C++ or tensor-op form)", "int8",
                 needs=lambda o: fbgemm_available(),
                 worth="int8, greedy/beam 4: 1.08x/1.08x AVX2-capped EPYC, 2026-11-29 (VNNI runs _int_mm: n/a)"),
    Optimisation("int8_vnni_int_mm", True, "our `_int_mm` int8 linear where it runs VNNI", "int8_kernel", "int_mm",
                 "fbgemm", "fbgemm's linear on VNNI CPUs too", "int8", row={"fbgemm_int8": True, "fused_ops": True},
                 needs=lambda o: int_mm_vnni(),
                 worth="int8 as shipped, greedy/beam 4: 1.21x/1.15x EPYC AVX-512 VNNI, 2026-11-29 (n/a on AVX2)"),
    Optimisation("int8_packed_gemm", True, "int8 product on weights packed once (C++, VNNI)", "int8_packed_gemm",
                 True, False, "`torch._int_mm` (oneDNN reorders the int8 weights on every call)", "int8",
                 row={"fbgemm_int8": True, "int8_vnni_int_mm": True, "fused_ops": True},
                 needs=lambda o: int_mm_vnni() and o.fused_ops and (o.int8_vnni_int_mm or not o.fbgemm_int8
                                                                    or not fbgemm_available()),
                 worth="int8 as shipped, greedy/beam 4: 1.06x/1.05x EPYC AVX-512 VNNI, 2026-11-29 (VNNI only)"),
    Optimisation("int8_gemv", True, "int8 gemv kernel at <= 4 rows (C++)", "int8_gemv_rows", 4, 0,
                 "fbgemm's `quantized::linear_dynamic` (or `_int_mm`) at every row count", "int8",
                 row={"fbgemm_int8": True},
                 worth="1.39x batch 1 (1.48x w/ shortlist), EPYC AVX-512, 2026-11-25; thrpt 1.07x, AVX2 1.27x"),
    Optimisation("fused_norm", True, "fused bias+residual+LayerNorm (C++)", "add_norm",
                 with_ops(add_norm_fused, "add_bias_residual_layernorm"),
                 add_norm_plain, "`add_norm_plain`: addmm, add, layer_norm", "step",
                 worth="1.03x throughput fp32, EPYC AVX-512, 2026-11-25; AVX2-capped 1.04x (earlier int8 1.05x)"),
    Optimisation("int8_quantized_hidden", True, "int8 fc1 quantises its output for fc2 (C++)", "hidden",
                 hidden_int8, hidden_plain, "fc1's float output, quantised again by fc2", "int8",
                 worth="1.11x greedy int8 as shipped, EPYC AVX-512 VNNI, 2026-11-29 (beam 4 1.00x; AVX2 1.01x/0.98x)"),
    Optimisation("fused_attention", True, "fused decode-step attention (C++)", "attend", op("decode_attention"),
                 attend_sdpa, "`scaled_dot_product_attention`", "step",
                 worth="int8 as shipped, greedy/beam 4: 1.09x/1.14x EPYC AVX-512 VNNI, 1.03x/1.09x AVX2, 2026-11-29"),
    Optimisation("fused_encoder_attention", True, "fused encoder self-attention (C++)", "encoder_attend",
                 with_ops(encoder_attend_fused, "encoder_attention"), encoder_attend_plain,
                 "chunk, head views, `scaled_dot_product_attention`, merge copy", "step",
                 worth="int8 as shipped, greedy/beam 4: 1.09x/1.03x EPYC AVX-512 VNNI, 1.02x/1.02x AVX2, 2026-11-29"),
    Optimisation("fused_cross_attention", True, "fused cross-attention on K/V arranged per batch (C++)",
                 "cross_kv",
                 Bound(cross_fused, ("cross_store",)), CrossPlain,
                 "`fused_attention`'s attention (or SDPA) on the cross K/V as projected, padding masked", "step",
                 worth="int8 as shipped, greedy/beam 4: 1.08x/1.07x EPYC AVX-512 VNNI, 1.02x/1.00x AVX2, 2026-11-29"),
    Optimisation("fused_project_argmax", True, "fused output projection + argmax (C++)", "argmax_in_step", True,
                 False, "`F.linear`, then the argmax", "greedy",
                 needs=lambda o: o.softmax_free and not o.no_repeat_ngram,
                 worth="1.09x greedy int8 as shipped, EPYC AVX-512 VNNI, 2026-11-29; AVX2 1.03x; fp32 1.37x"),
    Optimisation("fused_topk", True, "fused add+top-k (C++)", "topk",
                 with_ops(topk_split, "log_softmax_topk"), None,
                 "log-softmax, add, `Tensor.topk`", "beam",
                 worth="1.08x beam 4 int8 (with fused_log_softmax), AVX2-capped EPYC, 2026-11-29; VNNI 0.99x"),
    Optimisation("fused_log_softmax", True, "fused log-softmax+top-k (C++)", "topk",
                 with_ops(topk_one_pass, "log_softmax_topk"), None,
                 "fused_topk with ATen's log-softmax", "beam", needs=lambda o: o.fused_topk,
                 worth="1.01x beam 4 int8, AVX2-capped EPYC, 2026-11-29 (VNNI 1.00x): CPU noise; GPU not measured"),
    Optimisation("kv_row_table", True, "beam reorder through a row table", "kv_row_table", True, False,
                 "the live K/V cache copied to its new rows at every beam step (on a GPU the whole fixed-shape "
                 "buffer: read and written twice a step)", "beam",
                 needs=lambda o: o.fused_attention,
                 worth="1.11x beam 4 int8 as shipped, EPYC AVX-512 VNNI, 2026-11-29; AVX2 1.07x; GPU not measured"),
    Optimisation("fused_ngram", True, "n-gram blocking in C++", "block", op("ngram_block_"),
                 fused.ngram_block_reference, "`ngram_block_reference` (Python loop)", "ngram",
                 worth="--no-repeat-ngram 3, int8 as shipped: 1.19x greedy, 1.21x beam 4, EPYC VNNI, 2026-11-29"),
    Optimisation("cuda_graphs", True, "whole search steps replayed from CUDA graphs (small batches)",
                 "cuda_graphs", True, False, "eager steps: the decoder's and the search's ~14 (greedy) or ~35 "
                 "(beam) launches a step", "cuda", needs=lambda o: not o.shortlist and not o.no_repeat_ngram,
                 worth="whole-step graphs 1.69x batch 1, 0.85x at 8,192 rows, H200, 2026-11-27"),
    Optimisation("graph_reuse", True, "CUDA graphs kept per batch shape", "static_keep", 64, 0,
                 "a graph captured (and its state built) for every batch", "cuda",
                 worth="3.55x batch 1 (off 0.28x), H200, 2026-11-26; throughput off 1.09x (eager rows)"),
    Optimisation("normalise_processes", True, "a chunk's Moses normalisation in worker processes",
                 "normalise_processes", True, False, "normalised in the text pipeline's thread, which holds the GIL "
                 "meanwhile", "cuda", needs=lambda o: o.fast_normaliser,
                 worth="GPU not measured (1-line batch-1 H200 row only); 2 procs 46->31 ms/10k lines"),
    Optimisation("encode_ahead", True, "the next batch encoded before this one's search", "encode_ahead", True,
                 False, "each batch's inputs copied and encoded after the last batch's search has ended", "cuda",
                 worth="GPU not measured (only a 1-line batch-1 H200 row, off 0.90x, 2026-11-27)"),
    Optimisation("graph_attention", True, "decode-step attention kernel in the fixed-shape state",
                 "static_attend", True, False, "`scaled_dot_product_attention` over the whole cache with a -inf "
                 "bias past the position (cuDNN's flash attention on a GPU: a third of the H100's GPU time)", "cuda",
                 needs=lambda o: o.fused_attention,
                 worth="1.24x throughput (off 0.81x), 0.98x batch 1, H200, 2026-11-27"),
    Optimisation("one_row", True, "one-row greedy loop (latency)", "one_row", True, False,
                 "the batch loop at one row: tensor bookkeeping, `emb[ids]`, a padding mask", "batch1",
                 worth="1.11x batch 1, AMD EPYC AVX-512 1 thread, 2026-11-28; AVX2-capped 1.03x"),
    Optimisation("one_row_layer", True, "one-row decoder layer in one C++ call", "one_row_layer", True, False,
                 "the layer's ~25 ops at one row (gemv products, cache write, attention, norms)", "batch1",
                 row={"fused_norm": True}, needs=lambda o: o.one_row and o.fused_norm and o.fused_qkv,
                 worth="1.37x batch 1, AMD EPYC AVX-512 1 thread, 2026-11-28; AVX2-capped 1.26x"),
    Optimisation("one_row_step", True, "one-row decode step in one C++ call", "one_row_step", True, False,
                 "one_row_layer per layer, with the embedding, first norm, output projection and argmax "
                 "as ~10 tensor ops around them", "batch1",
                 row={"one_row_layer": True, "fused_norm": True},
                 needs=lambda o: o.one_row_layer and o.one_row and o.fused_norm and o.fused_qkv
                 and o.fused_project_argmax and o.softmax_free and not o.no_repeat_ngram,
                 worth="1.19x batch 1, AMD EPYC AVX-512 1 thread, 2026-11-28; AVX2-capped 1.13x"),
    Optimisation("shortlist", True, "lexical shortlist", "shortlist", True, False, "the full vocabulary",
                 "shortlist",
                 worth="int8 as shipped, greedy/beam 4: 1.09x/1.27x EPYC AVX-512 VNNI, 1.09x/1.34x AVX2, 2026-11-29"),
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
class StateOptions:
    """Which decoder state a batch runs on, and its options (decoder/state.py), resolved once."""
    eager: str = "incremental"  # "incremental" | "row_table": a batch's state where none below
    one_row: bool = False       # a greedy batch of one sentence: the one-row latency state
    static: bool = False        # batches of at most `graph_rows` rows: the fixed-shape state
    graph_rows: int = 0
    graphs: bool = False        # ... its steps replayed from CUDA graphs
    keep_states: int = 0        # fixed-shape states kept for later batches of their shape (graph_reuse)
    every: int = 1              # greedy: the steps of a block (the host reads after each)
    row_table: bool = False     # the fixed-shape beam state reorders a row table, not its K/V
    masked_attend: bool = False  # the fixed-shape state attends through the plan's kernel (a bool mask)
    one_row_layer: bool = False  # one-row state: each decoder layer one C++ call
    one_row_step: bool = False   # one-row state: the whole step one C++ call

    def kind(self, sentences: int, beam: int) -> str:
        """The state of a batch of `sentences` at `beam` (decoder/state.py new_state)."""
        if self.one_row and sentences == 1 and beam == 1:
            return "one_row"
        if self.static and sentences * beam <= self.graph_rows:
            return "static"
        return self.eager


@dataclass(frozen=True)
class Plan:
    """What the decoder runs, resolved once from the switches: the loop, the state and the
    functions the step calls. Nothing after `resolve` reads a switch."""
    sort: bool
    normalise: Callable         # greedy: logits -> what the argmax runs on
    early_stop: bool
    fused_qkv: bool
    pipeline: bool
    fast_normaliser: bool       # decoder/normalise.py in place of sacremoses' normalize (same output)
    switch_interval: float | None  # sys.setswitchinterval while the text pipeline's threads run (None: Python's)
    decode_ahead: bool          # the text pipeline decodes the next chunk while this one's outputs go out
    retain_memory: bool
    int8_fused: bool
    int8_kernel: str            # "fbgemm" | "int_mm": the int8 linear (decoder/quant.py)
    int8_packed_gemm: bool      # Int8Linear: our packed VNNI product in place of _int_mm (int8_gemm.cpp)
    int8_gemv_rows: int         # int8 calls of at most this many rows run our gemv kernel (0: none)
    add_norm: Callable          # (x, lin, inp, norm) -> (x + lin(inp), norm(...))
    hidden: Callable            # (ffn, y) -> act(fc1(y))
    attend: Callable            # decode-step attention (q, k, v, mask=None)
    cross_kv: Callable          # (k, v, mask, attend) -> a batch's cross K/V, kv(q (B, Q, d)) -> (B, Q, d)
    encoder_attend: Callable    # encoder self-attention (attn, y, heads, mask) -> (B, S, d)
    argmax_in_step: bool        # greedy: the state returns argmax columns itself
    topk: Callable | None       # beam: (logits, scores, K, n) -> top n; None = plain add + topk
    block: Callable             # n-gram blocking, in place
    encode_ahead: bool          # the next batch's inputs and encoder queued before this batch's search
    normalise_processes: bool   # the text pipeline's normaliser in worker processes (pipeline.NormalisePool)
    shortlist: bool
    states: StateOptions        # which state a batch runs on, and its options
    search: Callable            # (state, limits, Search, lims, vocab) -> Outputs: decoder/search.py's loop
    device: str = "cpu"         # "cpu" | "cuda"
    loop: str = "greedy"        # "greedy" | "beam"
    every: int = 1              # the loop reads its finished rows to the host every this many steps
    kernels: bool = False       # the device's fused kernels are loaded (C++ on CPU; CUDA: built and self-checked)
    runs: frozenset = frozenset()  # the switches that resolved on
    ops: fused.Ops = fused.REFERENCE  # the fused ops bound for the device and precision (Model.project_argmax)
    bound: tuple = ()           # (slot, whether its fused ops run kernels) for each such slot this loop calls

    def searcher(self, start_id: int, eos_id: int, pad_id: int, beam: int = 1, length_penalty: float = 1.0,
                 shrink_ratio: float = 0.25, no_repeat_ngram: int = 0) -> search.Search:
        """The loop's settings with the plan's functions bound in (decoder/search.py `Search`)."""
        pick = search.pick_in_step if self.argmax_in_step else \
            search.pick_argmax(self.normalise, self.block, no_repeat_ngram)
        return search.Search(start_id, eos_id, pad_id, beam, length_penalty, shrink_ratio, no_repeat_ngram,
                             every=self.every, shrink=self.early_stop, pick=pick, block=self.block,
                             topk=self.topk)

    def summary(self, precision: str = "fp32") -> str:
        """The plan in one clause of the settings line: loop, state, graphs, host reads, the
        switches of this device and loop that differ from their defaults, and which of the
        fused ops it calls run kernels (`ops_summary`)."""
        relevant = {"ladder", "step", "shortlist", self.loop, "batch1" if self.loop == "greedy" else "beam",
                    "int8" if precision == "int8" else "", self.device}
        diff = [("" if o.name in self.runs else "no ") + o.name for o in OPTIMISATIONS
                if o.bench in relevant and (o.name in self.runs) != o.default
                and o.name not in ("cuda_graphs", "shortlist")]
        st = self.states
        reads = "every step" if self.every == 1 else f"every {self.every} steps"
        static = "" if not st.static else (f", fixed-shape state up to {st.graph_rows} rows" if st.graph_rows < MAX_ROWS
                                          else ", fixed-shape state")
        return (f"{self.loop} loop, {st.eager} state" + (", one-row state at 1 sentence" if st.one_row else "")
                + static + f", CUDA graphs {'on' if st.graphs else 'off'}, host reads {reads}"
                + (", the model dir's shortlist" if self.shortlist else ", no shortlist")
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


# switches whose kernels exist for the CPU only: a CUDA plan, or a CPU's without the C++ ops, never holds
# them (their off path is the same math)
CPU_ONLY = frozenset({"fused_encoder_attention", "fused_cross_attention", "one_row_layer", "one_row_step"})
# switches that a CPU gains nothing from (or has no such thing): a CPU plan never holds them
CUDA_ONLY = frozenset({"cuda_graphs", "short_gil_interval", "encode_ahead", "decode_ahead", "normalise_processes"})
# switches whose off path beats their ops' PyTorch reference: on only where the device's kernels are loaded
WITH_KERNELS = frozenset({"kv_row_table"})
# switches whose CUDA kernel is one of its own, which its self-check may refuse alone (fused.OWN_FALLBACK)
OWN_KERNEL = {"kv_row_table": "decode_attention_rows"}
# host reads of the finished rows: every step on CPU (a read is a memory access there, and the
# per-step loops are the measured fastest); on CUDA a read stops the host until the GPU catches up
SYNC_EVERY = {"cpu": 1, "cuda": 8}
# greedy batches of at most this many rows decode on the fixed-shape state with graphs: batch 1
# needs them (the H200: 0.59x without), 8,192 rows ran 1.18x faster eagerly (docs/bench/gpu.md);
# where between the two they stop paying is not measured yet. Beam batches always take them.
GRAPH_ROWS = 256
MAX_ROWS = 1 << 30


def _allowed(name: str, device: str, k: Kernels) -> bool:
    kernel = OWN_KERNEL.get(name)
    if device == "cuda" and kernel is not None and not (k.cuda and kernel not in k.cuda_refused):
        return False
    if name in CUDA_ONLY:
        return device == "cuda"
    if name in CPU_ONLY:
        return device == "cpu" and k.cpu
    if name in WITH_KERNELS:
        return k.cuda if device == "cuda" else k.cpu
    return True


def resolve(switches, *, device: str = "cpu", beam: int = 1, no_repeat_ngram: int = 0,
            kernels: Kernels | None = None, static_shapes: bool = False, sync_every: int | None = None,
            precision: str = "fp32", has_shortlist: bool = True) -> Plan:
    """The Plan for `switches` (a Switches) on `device` ("cpu" | "cuda"), with `kernels`
    loaded (None: what this process has), at `beam` and `precision`: what the step calls
    (the fused ops bound to their kernels or references), which loop runs, on which
    state, how often the host reads, and whether graphs replay the steps: decided here
    and nowhere else. `no_repeat_ngram` and `has_shortlist` (the model dir has one)
    decide, with the other switches, each entry's `needs`.
    `static_shapes`: the fixed-shape state for every batch, without graphs, on any device;
    `sync_every`: host reads every this many steps (None: the device's)."""
    device = "cuda" if device.startswith("cuda") else "cpu"
    k = loaded_kernels(device) if kernels is None else kernels
    view = SimpleNamespace(**dataclasses.asdict(switches), no_repeat_ngram=no_repeat_ngram)
    # a graph replays fixed addresses, a batch's candidates are not: on CUDA the graphs take precedence
    graphs = device == "cuda" and view.cuda_graphs and not no_repeat_ngram
    if not has_shortlist or graphs:
        view.shortlist = False
    slots: dict = {}
    runs = set()
    for o in OPTIMISATIONS:
        slots.setdefault(o.slot, o.off)
        if getattr(view, o.name) and o.needs(view) and _allowed(o.name, device, k):
            slots[o.slot] = o.on
            runs.add(o.name)
    loop = "beam" if beam > 1 else "greedy"
    every = sync_every or SYNC_EVERY[device]
    slots["states"] = st = state_options(slots, runs, loop, device, k, static_shapes, every)
    loaded = k.cuda if device == "cuda" else k.cpu
    # the step's tensors are the precision's activations or fp32 (log-softmax): one dtype decides
    ops = fused.bound(device, DTYPES[precision], loaded)
    bound = bind(slots, ops, step_slots(slots, loop, no_repeat_ngram))
    for name in ("cuda_graphs", "static_keep", "static_attend", "kv_row_table", "one_row",
                 "one_row_layer", "one_row_step"):
        del slots[name]  # in `states` now
    run = search.beam if loop == "beam" else (greedy_or_one if st.one_row else search.greedy)
    return Plan(**slots, search=run, device=device, loop=loop, every=every, kernels=loaded, runs=frozenset(runs),
                ops=ops, bound=bound)


def state_options(slots: dict, runs: set, loop: str, device: str, k: Kernels, static_shapes: bool,
                  every: int) -> StateOptions:
    """Which state each batch runs on and its options, from the resolved slots; `runs` loses
    the switches that do not apply."""
    graphs = slots["cuda_graphs"]
    static = graphs or static_shapes
    masked = static and slots["static_attend"] and (device == "cpu" or k.cuda)
    # the row table: the CPU's eager beam state, or the fixed-shape one through the attention kernel
    # (SDPA reads no table); CUDA's eager state moves just the live K/V
    table = slots["kv_row_table"] and loop == "beam"
    eager = "row_table" if table and device == "cpu" else "incremental"
    one_row = slots["one_row"] and not static and loop == "greedy"
    drop = {"graph_reuse": not static, "graph_attention": not masked, "cuda_graphs": not graphs,
            "kv_row_table": not (eager == "row_table" or (table and masked)), "one_row": not one_row}
    runs -= {name for name, off in drop.items() if off}
    return StateOptions(
        eager=eager, one_row=one_row, static=static, graph_rows=MAX_ROWS if static_shapes or loop == "beam"
        else GRAPH_ROWS, graphs=graphs and device == "cuda", keep_states=slots["static_keep"] if static else 0,
        every=every, row_table=table and masked, masked_attend=masked,
        one_row_layer=one_row and slots["one_row_layer"], one_row_step=one_row and slots["one_row_step"])


def greedy_or_one(state, limits, s, lims: list[int], vocab=None):
    """Greedy where a batch of one sentence runs on the one-row state (StateOptions.kind):
    the latency step, else the batch loop."""
    if state.one_row:
        return search.Outputs.of([search.greedy_one(state, lims[0], s, vocab)])
    return search.greedy(state, limits, s, lims, vocab)


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
    """The slots that a decode with these resolved `slots` calls (the fixed-shape state attends
    with SDPA itself unless masked_attend; the eager state of larger batches calls the plan's)."""
    calls = {"add_norm", "hidden", "encoder_attend", "attend", "cross_kv"}
    if loop == "beam":
        calls.add("topk")
    else:
        calls |= {"argmax_in_step"} if slots["argmax_in_step"] else set()
    return calls | ({"block"} if no_repeat_ngram else set()) | ({"shortlist"} if slots["shortlist"] else set())


def table_markdown() -> str:
    """decoder/README.md's switch table."""
    rows = ["| switch | default | measured worth | what it does | replaces |", "|---|---|---|---|---|"]
    rows += [f"| `{o.name}` | {'on' if o.default else 'off'} | {o.worth} | {o.label} | {o.replaces} |"
             for o in OPTIMISATIONS]
    return "\n".join(rows)
