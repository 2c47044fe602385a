"""Text in and out: normalisation, SentencePiece, chunked async pipeline.

Pre-processing (Moses normalisation + SPM encode) of chunk k+1 and
detokenisation of each finished batch run in worker threads while the model
computes (FastSeq's async pipeline): torch releases the GIL inside its kernels,
so the Python of sacremoses overlaps with the matrix products.
"""
from __future__ import annotations

import itertools
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

from .modeldir import CONFIG, ModelConfig, ModelDirError, moses_options

# anything a line-based reader could split on must not leave the decoder
_LINE_BREAKS = re.compile("[\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def make_normaliser(cfg: ModelConfig) -> Callable[[str], str] | None:
    n = cfg.normaliser
    if not n:
        return None
    if n.get("type") != "moses-punct":
        raise ModelDirError(f"{CONFIG}: unknown normaliser type {n.get('type')!r}")
    from sacremoses import MosesPunctNormalizer
    mpn = MosesPunctNormalizer(lang=n.get("src_lang", cfg.src_lang),
                               **moses_options(n))
    return mpn.normalize


class Text:
    """Lines <-> token ids for one model dir."""

    def __init__(self, cfg: ModelConfig, spm_path: str, max_source_tokens: int):
        import sentencepiece as spm
        self.cfg = cfg
        self.sp = spm.SentencePieceProcessor(model_file=spm_path)
        self.normalise = make_normaliser(cfg)
        self.max_source_tokens = max_source_tokens
        self.warned = False

    def encode(self, lines: list[str]) -> list[list[int] | None]:
        """Source ids + </s> per line; None for an empty line (it never reaches the model)."""
        keep = [i for i, s in enumerate(lines) if s.strip()]
        texts = [lines[i] for i in keep]
        if self.normalise is not None:
            texts = [self.normalise(s) for s in texts]
        out: list = [None] * len(lines)
        limit = self.max_source_tokens - 1
        for i, ids in zip(keep, self.sp.encode(texts)):
            if len(ids) > limit:
                if not self.warned:
                    print(f"warning: input line {i + 1} of its chunk has {len(ids) + 1} tokens; "
                          f"truncating lines to the model limit of {limit + 1}", file=sys.stderr, flush=True)
                    self.warned = True
                ids = ids[:limit]
            out[i] = ids + [self.cfg.eos_id]
        return out

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [_LINE_BREAKS.sub(" ", s) for s in self.sp.decode(ids)]


def chunks(lines: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(lines)
    while True:
        c = list(itertools.islice(it, n))
        if not c:
            return
        yield c


def run(lines: Iterable[str], n: int, pre: Callable, compute: Callable, overlap: bool = True) -> Iterator[str]:
    """Chunked pipeline; yields one output per input line, in input order.

    pre(list[str]) -> state; compute(state, post_submit) -> finalize() -> list[str];
    compute hands each finished batch to `post_submit(fn, *args)` (a worker
    thread when overlapping) and returns a callable that assembles the chunk.
    """
    if not overlap:
        for c in chunks(lines, n):
            yield from compute(pre(c), lambda fn, *a: _Done(fn(*a)))()
        return
    it = chunks(lines, n)
    read_pre = lambda: (lambda c: None if c is None else pre(c))(next(it, None))  # noqa: E731
    with ThreadPoolExecutor(1, thread_name_prefix="pre") as pre_pool, \
            ThreadPoolExecutor(1, thread_name_prefix="post") as post_pool:
        fut = pre_pool.submit(read_pre)
        while True:
            state = fut.result()
            if state is None:
                return
            fut = pre_pool.submit(read_pre)  # read + encode the next chunk meanwhile
            yield from compute(state, post_pool.submit)()


class _Done:
    def __init__(self, v):
        self.v = v

    def result(self):
        return self.v
