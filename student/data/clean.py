"""Pair filtering (TenTrans WMT21 recipe) and Moses punctuation normalisation."""
from __future__ import annotations

import functools
import re
import tempfile
from typing import NamedTuple

import numpy as np

from decoder.modeldir import moses_options
from decoder.normalise import moses_punct

from . import dedup

# C0 controls except tab, DEL, and C1 controls: left in, they become odd pieces or
# break line-based tools downstream
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")

RULES = ("empty", "control_chars", "too_long", "ratio", "duplicate")


def clean_pairs(pairs, max_words: int = 200, min_ratio: float = 0.3, max_ratio: float = 2.0):
    """Drop bad pairs; returns (kept pairs, {rule: pairs removed, ..., "kept": n}).

    A pair is counted under the first rule (in RULES order) that rejects it.
    ratio = source words / target words. In memory: prepare() streams with Cleaner.
    """
    with tempfile.TemporaryDirectory() as spill:
        cleaner = Cleaner(max_words, min_ratio, max_ratio, spill)
        kept = cleaner.chunk(list(pairs))[0]
        cleaner.close()
    return kept, cleaner.counts


class Limits(NamedTuple):
    """The cleaning rules' bounds (picklable: they travel with each pool task)."""
    max_words: int
    min_ratio: float
    max_ratio: float

    def rule(self, src: str, tgt: str) -> str | None:
        """The first rule (RULES order, duplicates aside) that rejects the pair, or None."""
        ns, nt = len(src.split()), len(tgt.split())
        if not ns or not nt:
            return "empty"
        if _CONTROL.search(src) or _CONTROL.search(tgt):
            return "control_chars"
        if ns > self.max_words or nt > self.max_words:
            return "too_long"
        if not self.min_ratio <= ns / nt <= self.max_ratio:
            return "ratio"
        return None


class Screened(NamedTuple):
    """A chunk's pairs through every rule but `duplicate`: the per-pair half of cleaning,
    which a pool worker does (screen); the duplicate filter sees the whole stream (Cleaner.keep)."""
    src: list          # the pairs that passed, stripped, as UTF-8 bytes
    tgt: list
    hashes: np.ndarray  # (n,) uint64: their pair hashes
    removed: dict       # rule -> pairs it rejected


def screen(pairs, limits: Limits) -> Screened:
    """Strip each (source, target) text pair and apply the rules (module docstring)."""
    src, tgt, hashes, removed = [], [], [], dict.fromkeys(RULES, 0)
    for s, t in pairs:
        s, t = s.strip(), t.strip()
        rule = limits.rule(s, t)
        if rule:
            removed[rule] += 1
            continue
        s, t = s.encode(errors="surrogatepass"), t.encode(errors="surrogatepass")
        src.append(s)
        tgt.append(t)
        hashes.append(dedup.pair_hash(s, t))
    return Screened(src, tgt, np.array(hashes, np.uint64), removed)


class Cleaner:
    """clean_pairs over a stream, chunk by chunk, with counts over the whole stream.
    Duplicates are exact pairs (after strip), found by hash in bounded memory (dedup.py)."""

    def __init__(self, max_words: int, min_ratio: float, max_ratio: float, spill_dir: str,
                 bound: int = dedup.BOUND):
        self.limits = Limits(max_words, min_ratio, max_ratio)
        self.counts = {**dict.fromkeys(RULES, 0), "kept": 0}
        self.dedup = dedup.Dedup(spill_dir, bound)

    def chunk(self, pairs) -> tuple[list[tuple[str, str]], list[int]]:
        """(kept pairs, their sizes in UTF-8 bytes) of the next pairs of the stream."""
        src, tgt, sizes = self.keep(screen(pairs, self.limits))
        return [(s.decode(errors="surrogatepass"), t.decode(errors="surrogatepass")) for s, t in zip(src, tgt)], sizes

    def keep(self, screened: Screened) -> tuple[list[bytes], list[bytes], list[int]]:
        """(kept sources, targets, their sizes in bytes) of the next screened chunk of the stream:
        its pairs not seen before; the counts take in the chunk's."""
        for rule, n in screened.removed.items():
            self.counts[rule] += n
        new = self.dedup.first_seen(screened.hashes).tolist()
        src = [x for x, n in zip(screened.src, new) if n]
        tgt = [x for x, n in zip(screened.tgt, new) if n]
        self.counts["duplicate"] += len(new) - len(src)
        self.counts["kept"] += len(src)
        return src, tgt, [len(s) + len(t) for s, t in zip(src, tgt)]

    def close(self):
        self.dedup.close()


def normaliser_settings(src_lang: str, tgt_lang: str) -> dict:
    """The normaliser as plain data, recorded verbatim in config.json so the decoder rebuilds
    MosesPunctNormalizer(lang=<side>_lang, **modeldir.moses_options(settings)) without importing us."""
    return {"type": "moses-punct", "src_lang": src_lang, "tgt_lang": tgt_lang,
            "penn": True, "norm_quote_commas": True, "norm_numbers": True,
            "pre_replace_unicode_punct": True, "post_remove_control_chars": True}


def normalise(text: str, lang: str, settings: dict) -> str:
    if settings.get("type") != "moses-punct":
        raise ValueError(f"unknown normaliser type {settings.get('type')!r}")
    return _moses(lang, tuple(moses_options(settings).items()))(text)


def normalise_pairs(task) -> list[str]:
    """(UTF-8 pairs, src_lang, tgt_lang, settings) -> source, target, source, ... normalised: one pool task."""
    pairs, s_lang, t_lang, settings = task
    return [normalise(x.decode(errors="surrogatepass"), lang, settings)
            for pair in pairs for x, lang in zip(pair, (s_lang, t_lang))]


@functools.lru_cache(maxsize=None)
def _moses(lang: str, options: tuple):
    # building a normaliser compiles dozens of regexes; the trainer calls us per line
    return moses_punct(lang, **dict(options))
