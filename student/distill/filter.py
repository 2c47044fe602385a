"""Cleaning the distilled corpus: teachers fail in ways the original data does not.

A teacher can return nothing (or only punctuation), copy the source, loop ("the the the ..."), or
hallucinate far too long or short outputs; the student would learn each of those.
"""
from __future__ import annotations

import re

RULES = ("empty", "copy", "repetitive", "ratio")
_WORDY = re.compile(r"[^\W_]")  # a letter or digit, in any script


def one_line(text: str) -> str:
    # str.split() also eats \r, \x1c-\x1e, \x85, U+2028/9: every character that
    # str.splitlines (the trainer's reader) would treat as a line break
    return " ".join(text.split())


def repetitive(words: list[str], max_repeat: int = 4, max_share: float = 0.5) -> bool:
    """A word or n-gram (n <= 4) repeated more than max_repeat times in a row, or
    one word (not punctuation) making up more than max_share of an output of 8+ words."""
    n = len(words)
    for size in range(1, 5):
        for i in range(n - size * max_repeat):
            gram, reps, j = words[i:i + size], 1, i + size
            while words[j:j + size] == gram:
                reps, j = reps + 1, j + size
            if reps > max_repeat:
                return True
    real = [w for w in words if not re.fullmatch(r"\W+", w)]
    if len(real) >= 8:
        top = max(real.count(w) for w in set(real))
        if top / len(real) > max_share:
            return True
    return False


def clean_distilled(src: list[str], hyp: list[str], min_ratio: float = 0.3, max_ratio: float = 2.5,
                    max_repeat: int = 4):
    """(kept source lines, kept translations, {rule: removed, "kept": n}); ratio = source/target words."""
    counts = {}
    kept = list(iter_clean_distilled(zip(src, hyp), counts, min_ratio, max_ratio, max_repeat))
    return [s for s, _ in kept], [h for _, h in kept], counts


def iter_clean_distilled(pairs, counts: dict, min_ratio: float = 0.3, max_ratio: float = 2.5,
                         max_repeat: int = 4):
    """clean_distilled over a stream of (source, translation): yields the kept pairs; `counts`
    holds the removals by rule and "kept" once the stream is through."""
    counts.update(dict.fromkeys(RULES, 0), kept=0)
    for s, h in pairs:
        s, h = one_line(s), one_line(h)
        sw, hw = s.split(), h.split()
        if not sw or not hw or (not _WORDY.search(h) and _WORDY.search(s)):
            rule = "empty"  # nothing, or only punctuation (",,,,") for a source with words
        elif s == h and len(sw) > 2:
            rule = "copy"  # the teacher passed the source through untranslated
        elif repetitive(hw, max_repeat):
            rule = "repetitive"
        elif not min_ratio <= len(sw) / len(hw) <= max_ratio:
            rule = "ratio"
        else:
            counts["kept"] += 1
            yield s, h
            continue
        counts[rule] += 1
