"""`Translator`: the library entry point. Every optimisation is a switch
(decoder/optimisations.py), resolved once here into the `Plan` the model and
the searches call, so the benchmarks (tools/) can turn them on one at a time."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Iterable, Iterator

import torch

from . import hostsync, modeldir
from .cliargs import MAX_BEAM, MAX_INT, MAX_LEN, MAX_LENGTH_PENALTY, max_sentences_for, max_tokens_for
from .batching import make_batches, padded, restore
from .model import Model
from .optimisations import BY_NAME, Switches, resolve
from .pipeline import NormalisePool, Text, normalise_processes, run, shares
from .quant import fbgemm_available, int_mm_vnni
from .runtime import retain_freed_memory
from .search import Outputs
from .shortlist import Shortlist
from .state import new_state
from .workers import WorkerPool


@dataclass
class Options:
    """Decoding settings, and the optimisation switches (decoder/optimisations.py)."""
    beam: int = 1
    shrink_ratio: float = 0.25  # finished sentences leave the batch once this fraction of rows has finished
    no_repeat_ngram: int = 0    # >0: no n-gram of this size twice in an output (fairseq's no_repeat_ngram_size)
    length_penalty: float = 1.0
    max_len_a: float = 1.5      # output cap a * source tokens + b
    max_len_b: int = 10
    max_tokens: int | None = None  # padded source tokens per batch; None: cliargs.max_tokens_for(beam, device)
    max_sentences: int | None = None  # None: cliargs.max_sentences_for(beam, device)
    chunk_lines: int = 20000    # lines read, sorted and batched together
    workers: int = 0            # CPU: >1 = that many pinned 1-thread processes fed whole batches (workers.py)
    static_shapes: bool = False  # the fixed-shape (CUDA-graph) cache without graphs, on any device (tests)
    sync_every: int | None = None  # host reads of the finished rows every N steps; None: the device's (Plan)
    switches: Switches = field(default_factory=Switches)

    def __post_init__(self):
        for name, kind, lo, hi in self.RANGES:  # the CLI's bounds (decoder/cliargs.py), for library callers
            v = getattr(self, name)
            if v is None and name in self.DEVICE_DEFAULTS:
                continue  # filled in for the device (for_device)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
            if not (ok and math.isfinite(v) and lo <= v <= hi):
                raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'} "
                                 f"in [{lo}, {hi}], got {v!r}"[:200])

    RANGES = (("beam", int, 1, MAX_BEAM), ("length_penalty", float, 0.0, MAX_LENGTH_PENALTY),
              ("max_len_a", float, 0.0, MAX_LEN), ("max_len_b", int, 0, MAX_LEN),
              ("no_repeat_ngram", int, 0, MAX_LEN), ("max_tokens", int, 1, MAX_INT),
              ("max_sentences", int, 1, MAX_INT), ("chunk_lines", int, 1, MAX_INT),
              ("shrink_ratio", float, 0.0, 1.0), ("workers", int, 0, MAX_INT), ("sync_every", int, 1, MAX_INT))
    DEVICE_DEFAULTS = ("max_tokens", "max_sentences", "sync_every")  # None: the device's

    def for_device(self, device: str) -> "Options":
        """These options with the batch sizes the user left unset filled in for `device`."""
        return dataclasses.replace(
            self, max_tokens=self.max_tokens or max_tokens_for(self.beam, device),
            max_sentences=self.max_sentences or max_sentences_for(self.beam, device))

    @classmethod
    def make(cls, **kw) -> "Options":
        """From one flat keyword list of settings and switch names."""
        sw = {k: kw.pop(k) for k in list(kw) if k in BY_NAME}
        return cls(**kw, switches=Switches(**sw))

    def flat(self) -> dict:
        """The inverse of `make`."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "switches"}
        return {**d, **asdict(self.switches)}


def default_precision(device: str) -> str:
    """The precision where none is asked for: what the container runs. CPU: int8 where the CPU
    has an int8 kernel (fbgemm, or `_int_mm` with VNNI; 4.0x fp32 with the shortlist and 2 workers
    on an AVX2-only CPU), else fp32. CUDA: fp16, tensor-core products (on the H100 107k words/s
    against fp32's 72k)."""
    if device.startswith("cuda"):
        return "fp16"
    return "int8" if fbgemm_available() or int_mm_vnni() else "fp32"


NO_CUDA = "warning: CUDA is not available; running on CPU"


def runs_on(device: str) -> str:
    """The device that will run: CUDA asked for where there is none runs on the CPU
    (`resolve_device_precision` says so)."""
    return "cpu" if device.startswith("cuda") and not torch.cuda.is_available() else device


def resolve_device_precision(device: str, precision: str | None, warn: bool = True) -> tuple[str, str]:
    """(device, precision) that will actually run; falls back to CPU without CUDA, with a
    warning (`warn`: a caller resolving many rows says it once itself). None or "auto":
    the device's default (`default_precision`), decided here once."""
    if runs_on(device) != device:
        if warn:
            print(NO_CUDA, file=sys.stderr, flush=True)
        device = "cpu"
        if precision == "fp16":
            precision = None
    if precision in (None, "auto"):
        precision = default_precision(device)
    if device == "cpu" and precision == "fp16":
        raise ValueError("fp16 is a GPU precision; use bf16 or int8 on CPU")
    if device.startswith("cuda") and precision == "int8":
        raise ValueError("int8 is a CPU precision; use fp16 on CUDA")
    if precision not in ("fp32", "bf16", "int8", "fp16"):
        raise ValueError(f"unknown precision {precision!r}")
    return device, precision


_UNTIMED = contextlib.nullcontext()


class Translator:
    @staticmethod
    def phase(name: str):
        """The context each decoding phase runs in ("encode", "decode steps",
        "batch shrink"): a hook for profilers (tools/bench.py times the phases by
        setting it on an instance); by default nothing."""
        return _UNTIMED

    def __init__(self, model_dir: str, *, device: str = "cpu", precision: str | None = None,
                 threads: int | None = None, **options):
        """`options`: Options' settings and the switches of decoder/optimisations.py, by name."""
        # one resolution: the device, its batch sizes, the precision, then the plan of what runs there
        self.opts = o = Options.make(**options).for_device(runs_on(device))
        if threads:
            torch.set_num_threads(threads)  # process-wide: torch has one intra-op pool
        cfg, weights, spm_path = modeldir.load(model_dir)
        # the shortlist where the dir lists and has one (as the container); asked for by name, it must
        listed = modeldir.has_shortlist(model_dir, cfg)
        if options.get("shortlist") and not listed:
            modeldir.read_shortlist(model_dir, cfg)  # the error that names what is missing
        self.device, self.precision = resolve_device_precision(device, precision)
        self.plan = resolve(o.switches, device=self.device, beam=o.beam, no_repeat_ngram=o.no_repeat_ngram,
                            static_shapes=o.static_shapes, sync_every=o.sync_every, precision=self.precision,
                            has_shortlist=listed)
        if self.plan.retain_memory:
            retain_freed_memory()
        self.cfg = cfg
        self.text = Text(cfg, spm_path, cfg.arch.max_positions, fast_normaliser=self.plan.fast_normaliser)
        n = normalise_processes() if self.plan.normalise_processes else 0
        if n and self.text.normalise is not None:
            self.text.pool = NormalisePool.shared(cfg, n)  # started now (once a process), while the model loads
        self.search = self.plan.searcher(cfg.decoder_start_id, cfg.eos_id, cfg.pad_id, beam=o.beam,
                                         length_penalty=o.length_penalty, shrink_ratio=o.shrink_ratio,
                                         no_repeat_ngram=o.no_repeat_ngram)
        self.shortlist = self.model = self.pool = None
        if o.workers > 1:
            if self.device != "cpu":
                raise ValueError("workers are CPU processes; use one process on CUDA")
            if self.plan.shortlist:
                modeldir.read_shortlist(model_dir, cfg)  # a bad file fails here, once, not in each worker
            # the model lives in the workers only; they get the precision already resolved
            kw = {k: v for k, v in o.flat().items() if k not in ("workers", "pipeline")}
            kw["shortlist"] = self.plan.shortlist  # resolved: the dir's, where it has one
            self.pool = WorkerPool(partial(Translator, model_dir, device="cpu", precision=self.precision,
                                           threads=1, **kw), o.workers)
            return
        self.model = Model(cfg, weights, self.plan, precision=self.precision, device=self.device)
        if self.plan.shortlist:
            self.shortlist = Shortlist(*modeldir.read_shortlist(model_dir, cfg), eos_id=cfg.eos_id,
                                       device=self.model.device, candidates=self.plan.ops.shortlist_candidates)

    def state_kind(self, sentences: int = 2) -> str:
        """The decoder state a batch of `sentences` runs on (decoder/state.py): the plan's."""
        return self.plan.states.kind(sentences, self.opts.beam)

    # -- token level ---------------------------------------------------------------
    def limits(self, lengths: list[int]) -> torch.Tensor:
        o, a = self.opts, self.cfg.arch
        # same formula (and float32 rounding) as student.model.Transformer.greedy; at least one
        # step, the one that forces </s>: a cap below one token is an empty output, not no search
        n = torch.tensor(lengths, dtype=torch.float)
        return torch.clamp((n * o.max_len_a + o.max_len_b).long(), min=1, max=a.max_positions - 1)

    def translate_ids(self, srcs: list[list[int]]) -> list[list[int]]:
        """Source ids (with </s>) of one batch -> target ids (without </s>)."""
        if self.pool is not None:
            return self.pool.submit(srcs).result()
        return self.start_ids(srcs).result()

    def start_ids(self, srcs: list[list[int]]) -> Outputs:
        """translate_ids, its outputs read where `.result()` is called: on CUDA the host
        goes on to the next batch while their copy is under way."""
        return self.search_batch(self.encode_batch(srcs))

    @torch.inference_mode()
    def encode_batch(self, srcs: list[list[int]]) -> "Encoded":
        """One batch's inputs on the device and its encoder run (on CUDA: queued)."""
        o, c = self.opts, self.cfg
        src = hostsync.to_device(padded(srcs, c.pad_id), self.model.device)  # (B, S)
        lims = self.limits([len(s) for s in srcs])  # (B,) built on the host: no read to find its max
        limits, lims = hostsync.to_device(lims, self.model.device), lims.tolist()
        with self.phase("encode"):
            enc, mask = self.model.encode(src)
        vocab = out = None
        if self.shortlist is not None:  # one candidate set and one sliced projection per batch
            vocab = self.shortlist.candidates(src)  # (C,)
            out = self.model.output_rows(vocab, len(srcs) * o.beam)
        return Encoded(enc, mask, limits, lims, vocab, out)

    @torch.inference_mode()
    def search_batch(self, e: "Encoded") -> Outputs:
        """An encoded batch searched (decoder/search.py); its outputs as `start_ids` gives them."""
        return Outputs.of(self.plan.search(self.new_state(e), e.limits, self.search, e.lims, e.vocab))

    def new_state(self, e: "Encoded"):
        """The batch's decoder state, of the kind the plan fixed (decoder/state.py)."""
        return new_state(self.model, e.enc, e.mask, self.opts.beam, max(e.lims), e.out, self.phase)

    # -- text level ----------------------------------------------------------------
    # Chunks of at least this many lines are encoded by the workers, a share each; below it
    # one round trip to a worker (~0.1-0.2 ms) costs more than the parent's own encoding.
    SPLIT_ENCODE_LINES = 64

    def ids(self, lines: list[str]):
        """Text.ids in this process: what the workers run on their share of a chunk."""
        return self.text.ids(lines)

    def detokenise(self, outputs: Outputs) -> list[str]:
        """A batch's outputs read and detokenised: the text pipeline's thread runs it."""
        return self.text.decode(outputs.result())

    def translate_text(self, srcs: list[list[int]]) -> list[str]:
        """translate_ids, then detokenised: what the workers run on a batch."""
        return self.text.decode(self.translate_ids(srcs))

    def _encode(self, lines: list[str]) -> list:
        """Text.encode; with workers, each encodes a contiguous share of the chunk (by characters),
        while in one process every worker would wait for the parent."""
        if self.pool is None or len(lines) < self.SPLIT_ENCODE_LINES:
            return self.text.encode(lines)
        jobs = [(lo, self.pool.submit(lines[lo:hi], "ids")) for lo, hi in shares(lines, self.pool.n)]
        out, cut = [], []
        for lo, job in jobs:
            ids, c = job.result()
            out += ids
            cut += [(lo + i, n) for i, n in c]
        self.text.seen(len(lines), cut)
        return out

    def _compute(self, srcs: list, submit):
        o = self.opts
        idx = [i for i, s in enumerate(srcs) if s is not None]
        batches = make_batches([len(srcs[i]) for i in idx], o.max_tokens, o.max_sentences, self.plan.sort)
        if self.pool is not None:
            # every batch of the chunk is queued first, so the workers never wait on the parent
            futs = [self.pool.submit([srcs[idx[j]] for j in b], "translate_text") for b in batches]
        else:
            futs = [submit(self.detokenise, out) for out in self.each_batch([[srcs[idx[j]] for j in b]
                                                                                for b in batches])]

        def finish() -> list[str]:
            done = restore(batches, [f.result() for f in futs], len(idx))
            out = [""] * len(srcs)  # empty lines stay empty
            for i, s in zip(idx, done):
                out[i] = s
            return out
        return finish

    def each_batch(self, batches: list[list[list[int]]]) -> Iterator[Outputs]:
        """Each batch's outputs, in order. With plan.encode_ahead the next batch is encoded
        before this one's search: on CUDA its inputs' copy and encoder are queued behind this
        batch's work, so the GPU has them when the search's last read returns."""
        if not self.plan.encode_ahead:
            yield from map(self.start_ids, batches)
            return
        ahead = self.encode_batch(batches[0]) if batches else None
        for nxt in batches[1:] + [None]:
            this, ahead = ahead, None if nxt is None else self.encode_batch(nxt)
            yield self.search_batch(this)

    def translate_stream(self, lines: Iterable[str]) -> Iterator[str]:
        """One output per input line, in order, produced chunk by chunk."""
        return run(lines, self.opts.chunk_lines, self._encode, self._compute, overlap=self.plan.pipeline,
                   switch_interval=self.plan.switch_interval, decode_ahead=self.plan.decode_ahead)

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


@dataclass
class Encoded:
    """A batch between `Translator.encode_batch` and `Translator.search_batch`."""
    enc: torch.Tensor           # (B, S, d) encoder output
    mask: torch.Tensor          # its padding mask
    limits: torch.Tensor        # (B,) on the device: most target tokens, </s> included
    lims: list[int]             # the same on the host
    vocab: torch.Tensor | None  # (C,) the shortlist's candidates, or None
    out: object | None          # the shortlist's sliced output projection, or None
