"""Text in and out: normalisation, SentencePiece, chunked async pipeline.

Pre-processing (Moses normalisation + SPM encode) of chunk k+1 and
detokenisation of each finished batch run in worker threads while the model
computes (FastSeq's async pipeline): torch releases the GIL inside its kernels,
so the Python of sacremoses overlaps with the matrix products.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Iterable, Iterator

import torch

from .modeldir import CONFIG, ModelConfig, ModelDirError, moses_options
from .normalise import MosesPunct, moses_punct
from .textio import line_cap

# anything a line-based reader could split on must not leave the decoder
_LINE_BREAKS = re.compile("[\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
# Memory bounds. A chunk holds at most chunk_lines lines and CHUNK_CHARS
# characters (each line at most textio.line_cap): 16 Mi characters is about
# 100 000 ordinary sentences, so it cuts only chunks of very long lines.
# SentencePiece encodes ENCODE_CHARS characters at a time before truncation.
CHUNK_CHARS = 1 << 24
ENCODE_CHARS = 1 << 20
# switch normalise_processes: groups of at least this many lines go to the pool, in a share for each
# process (fewer are normalised here: a round trip to a process costs ~0.1-0.2 ms, decoder/workers.py)
POOL_LINES = 256


def make_normaliser(cfg: ModelConfig, fast: bool = True) -> Callable[[str], str] | None:
    """The model's source normaliser: sacremoses' rules, run by decoder/normalise.py
    (`fast`, switch fast_normaliser) or by sacremoses itself; None where it has none."""
    n = cfg.normaliser
    if not n:
        return None
    if n.get("type") != "moses-punct":
        raise ModelDirError(f"{CONFIG}: unknown normaliser type {n.get('type')!r}")
    from sacremoses import MosesPunctNormalizer
    mpn = MosesPunctNormalizer(lang=n.get("src_lang", cfg.src_lang),
                               **moses_options(n))
    return MosesPunct(mpn) if fast else mpn.normalize


def normalise_processes(cores: int | None = None) -> int:
    """The normaliser's processes on a machine of `cores` cores (default: those this process may
    run on) (switch normalise_processes): half of them, at most 8, leaving the rest to the decoding,
    SentencePiece and detokenising threads; none below 4 cores, where a process would take a core
    from the decoding."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return 0 if cores < 4 else min(8, cores // 2)


class NormalisePool:
    """The model's fast normaliser (Moses, pure Python: the text pipeline's thread held the
    GIL for it, about 4.5 us a line) in worker processes (decoder/workers.py, which restarts
    a dead one, falls back to this process and never outlives it), each on a contiguous share
    of the lines. The workers import neither torch nor the model. One pool per process and
    normaliser (`shared`), as a process has one GIL: every Translator of it uses that one."""

    def __init__(self, lang: str, options: dict, n: int):
        from .workers import WorkerPool
        self.pool = WorkerPool(partial(moses_punct, lang, **options), n)

    @classmethod
    def shared(cls, cfg: ModelConfig, n: int) -> "NormalisePool":
        """This process's pool for cfg's normaliser, started on first use."""
        norm = cfg.normaliser
        lang, options = norm.get("src_lang", cfg.src_lang), moses_options(norm)
        key = (lang, tuple(sorted(options.items())), n)
        with _POOLS_LOCK:
            if key not in _POOLS:
                _POOLS[key] = cls(lang, options, n)
            return _POOLS[key]

    def many(self, lines: list[str]) -> list[str]:
        jobs = [self.pool.submit(lines[lo:hi], "many") for lo, hi in shares(lines, max(self.pool.n, 1))]
        return [s for job in jobs for s in job.result()]

    def close(self) -> None:
        self.pool.close()


_POOLS: dict = {}
_POOLS_LOCK = threading.Lock()


def shares(lines: list[str], n: int) -> list[tuple[int, int]]:
    """(lo, hi) of n contiguous runs of lines with about equal characters (none empty)."""
    total, cuts, acc = sum(map(len, lines)) or 1, [0], 0
    for i, line in enumerate(lines):
        acc += len(line)
        if len(cuts) < n and acc * n >= total * len(cuts) and i + 1 < len(lines):
            cuts.append(i + 1)
    cuts.append(len(lines))
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


class Text:
    """Lines <-> token ids for one model dir."""

    def __init__(self, cfg: ModelConfig, spm_path: str, max_source_tokens: int, fast_normaliser: bool = True):
        import sentencepiece as spm
        self.cfg = cfg
        # as many threads as torch's pool, not SentencePiece's default of one per core per call: a
        # 1-thread worker starts none, and under a process limit a refused thread aborted the process
        self.sp = spm.SentencePieceProcessor(model_file=spm_path, num_threads=torch.get_num_threads())
        self.normalise = make_normaliser(cfg, fast_normaliser)
        self.pool: NormalisePool | None = None  # the Translator's, where normalise_processes resolved
        self.max_source_tokens = max_source_tokens
        # what textio.read_lines caps the CLI's lines at, for lines handed over in memory
        self.max_line_chars = line_cap(max_source_tokens)
        self.lines_seen = 0  # lines encoded so far: a warning names the line in the whole input
        self.warned = False

    def encode(self, lines: list[str]) -> list[list[int] | None]:
        """Source ids + </s> per line; None for an empty line (it never reaches the model)."""
        out, cut = self.ids(lines)
        self.seen(len(lines), cut)
        return out

    def ids(self, lines: list[str]) -> tuple[list[list[int] | None], list[tuple[int, int]]]:
        """`encode` without its warning, so that any process can run it: the ids, and
        (index in lines, untruncated token count) of each line cut to the model's limit."""
        keep = [i for i, s in enumerate(lines) if s.strip()]
        out: list = [None] * len(lines)
        cut: list[tuple[int, int]] = []
        limit = self.max_source_tokens - 1
        # a few lines at a time: ids are truncated before the next group is encoded,
        # so untruncated ids never exceed about ENCODE_CHARS tokens
        for group in _groups(keep, [min(len(lines[i]), self.max_line_chars) for i in keep], ENCODE_CHARS):
            texts = [lines[i][:self.max_line_chars] for i in group]
            if self.pool is not None and len(texts) >= POOL_LINES:
                texts = self.pool.many(texts)
            elif self.normalise is not None:
                texts = [self.normalise(s) for s in texts]
            for i, ids in zip(group, self.sp.encode(texts)):
                if len(ids) > limit:
                    cut.append((i, len(ids) + 1))
                    ids = ids[:limit]
                out[i] = ids + [self.cfg.eos_id]
        return out, cut

    def seen(self, n: int, cut: list[tuple[int, int]]) -> None:
        """Counts n more input lines, `cut` (from `ids`) among them: the first line
        truncated in the whole input is named once, by its line number there."""
        first, self.lines_seen = self.lines_seen, self.lines_seen + n
        if cut and not self.warned:
            i, tokens = cut[0]
            print(f"warning: input line {first + i + 1} has {tokens} tokens; "
                  f"truncating lines to the model limit of {self.max_source_tokens}", file=sys.stderr, flush=True)
            self.warned = True

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [_LINE_BREAKS.sub(" ", s) for s in self.sp.decode(ids)]


def _groups(items: list, sizes: list[int], budget: int) -> Iterator[list]:
    """items in order, in runs whose sizes add up to at most budget (or one item)."""
    group, total = [], 0
    for item, size in zip(items, sizes):
        if group and total + size > budget:
            yield group
            group, total = [], 0
        group.append(item)
        total += size
    if group:
        yield group


def chunks(lines: Iterable[str], n: int, max_chars: int = CHUNK_CHARS) -> Iterator[list[str]]:
    """Runs of n lines, shorter where their characters reach max_chars. A run is
    yielded as soon as it is full: a pipe reader gets its answer before the next line."""
    c, size = [], 0
    for line in lines:
        c.append(line)
        size += len(line)
        if len(c) == n or size >= max_chars:
            yield c
            c, size = [], 0
    if c:
        yield c


def run(lines: Iterable[str], n: int, pre: Callable, compute: Callable, overlap: bool = True,
        switch_interval: float | None = None, decode_ahead: bool = False) -> Iterator[str]:
    """Chunked pipeline; yields one output per input line, in input order.

    pre(list[str]) -> state; compute(state, post_submit) -> finalize() -> list[str];
    compute hands each finished batch to `post_submit(fn, *args)` (a worker
    thread when overlapping) and returns a callable that assembles the chunk.
    `switch_interval`: Python's thread switch interval while the threads run
    (switch short_gil_interval), restored after; process-wide, as Python has one.
    `decode_ahead`: compute runs in a thread of its own, and the next chunk, where
    it is already read, is computed while this one's outputs are handed out.
    """
    if not overlap:
        for c in chunks(lines, n):
            yield from compute(pre(c), lambda fn, *a: _Done(fn(*a)))()
        return
    it = chunks(lines, n)
    read_pre = lambda: (lambda c: None if c is None else pre(c))(next(it, None))  # noqa: E731
    with switch_interval_of(switch_interval), ThreadPoolExecutor(1, thread_name_prefix="pre") as pre_pool, \
            ThreadPoolExecutor(1, thread_name_prefix="post") as post_pool:
        fut = pre_pool.submit(read_pre)
        if decode_ahead:
            yield from _decoded_ahead(fut, lambda: pre_pool.submit(read_pre), compute, post_pool.submit)
            return
        while True:
            state = fut.result()
            if state is None:
                return
            fut = pre_pool.submit(read_pre)  # read + encode the next chunk meanwhile
            yield from compute(state, post_pool.submit)()


def _decoded_ahead(fut, read_next: Callable, compute: Callable, post_submit: Callable) -> Iterator[str]:
    """`run`'s loop with compute in a thread of its own. When a chunk is computed and the next
    is already read and encoded, the next one's compute starts before this one's outputs are
    handed out: on a GPU, the decoding goes on while the outputs are written. A next chunk not
    yet read is waited for only after the outputs are out: a pipe's writer may be waiting for
    them before it writes more."""
    with ThreadPoolExecutor(1, thread_name_prefix="decode") as decode_pool:
        job = None
        while True:
            if job is None:
                state = fut.result()
                if state is None:
                    return
                fut, job = read_next(), decode_pool.submit(compute, state, post_submit)
            finish, job = job.result(), None
            if fut.done():
                state = fut.result()
                if state is not None:
                    fut, job = read_next(), decode_pool.submit(compute, state, post_submit)
            yield from finish()


@contextlib.contextmanager
def switch_interval_of(seconds: float | None):
    """sys.setswitchinterval(seconds) inside, the interval before restored after; None: unchanged."""
    before = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class _Done:
    def __init__(self, v):
        self.v = v

    def result(self):
        return self.v
