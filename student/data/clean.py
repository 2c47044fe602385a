"""Pair filtering (TenTrans WMT21 recipe) and Moses punctuation normalisation."""
from __future__ import annotations

import functools
import re

from decoder.modeldir import moses_options

# C0 controls except tab, DEL, and C1 controls: left in, they become odd pieces or
# break line-based tools downstream
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")

RULES = ("empty", "control_chars", "too_long", "ratio", "duplicate")


def clean_pairs(pairs, max_words: int = 200, min_ratio: float = 0.3, max_ratio: float = 2.0):
    """Drop bad pairs; returns (kept pairs, {rule: pairs removed, ..., "kept": n}).

    A pair is counted under the first rule (in RULES order) that rejects it.
    ratio = source words / target words.
    """
    counts = dict.fromkeys(RULES, 0)
    seen, kept = set(), []
    for src, tgt in pairs:
        src, tgt = src.strip(), tgt.strip()
        ns, nt = len(src.split()), len(tgt.split())
        if not ns or not nt:
            rule = "empty"
        elif _CONTROL.search(src) or _CONTROL.search(tgt):
            rule = "control_chars"
        elif ns > max_words or nt > max_words:
            rule = "too_long"
        elif not min_ratio <= ns / nt <= max_ratio:
            rule = "ratio"
        elif (src, tgt) in seen:
            rule = "duplicate"
        else:
            seen.add((src, tgt))
            kept.append((src, tgt))
            continue
        counts[rule] += 1
    counts["kept"] = len(kept)
    return kept, counts


def normaliser_settings(src_lang: str, tgt_lang: str) -> dict:
    """The normaliser as plain data, recorded verbatim in config.json so the decoder rebuilds
    MosesPunctNormalizer(lang=<side>_lang, **modeldir.moses_options(settings)) without importing us."""
    return {"type": "moses-punct", "src_lang": src_lang, "tgt_lang": tgt_lang,
            "penn": True, "norm_quote_commas": True, "norm_numbers": True,
            "pre_replace_unicode_punct": True, "post_remove_control_chars": True}


def normalise(text: str, lang: str, settings: dict) -> str:
    if settings.get("type") != "moses-punct":
        raise ValueError(f"unknown normaliser type {settings.get('type')!r}")
    return _moses(lang, tuple(moses_options(settings).items())).normalize(text)


@functools.lru_cache(maxsize=None)
def _moses(lang: str, options: tuple):
    # building a normaliser compiles dozens of regexes; the trainer calls us per line
    from sacremoses import MosesPunctNormalizer
    return MosesPunctNormalizer(lang=lang, **dict(options))
