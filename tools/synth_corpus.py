"""A synthetic parallel corpus of any size, for measuring data preparation at WMT scale.

    python -m tools.synth_corpus --pairs 10000000 --out /data/synth   # writes train.en, train.de

Sentences of 4-40 pseudo-words drawn from a Zipfian vocabulary of 30,000 words a
side, with capitals, commas, quotes and final punctuation for the Moses
normaliser to work on; the target side is the source's words mapped one to one,
in a slightly different order. The first three words of every source sentence
spell the pair's number in base 1000, so no two pairs are equal and nothing
deduplicates away, and every pair passes the cleaning rules: prepare keeps all
pairs but the 2,000 it holds out for dev and test. Deterministic for a seed.
"""
from __future__ import annotations

import os
import re
import sys

import numpy as np
from tqdm import tqdm

from decoder.cliargs import ArgumentParser, add_version, nonneg_int, out_dir_error, positive_int, refuse, run

BLOCK = 50_000
VOCAB = 30_000
COUNTER = 1_000


def words(rng: np.random.Generator, n: int, onsets: str, vowels: str) -> list[str]:
    """n distinct pseudo-words of 1-4 syllables."""
    out, seen = [], set()
    while len(out) < n:
        w = "".join(rng.choice(list(onsets)) + rng.choice(list(vowels)) for _ in range(rng.integers(1, 5)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def block(rng, start: int, n: int, src_words, tgt_words, counter_src, counter_tgt):
    """(source lines, target lines) for pairs start .. start + n - 1."""
    lens = rng.integers(1, 38, n)  # plus the three counter words
    ids = np.minimum(rng.zipf(1.3, lens.sum()) - 1, VOCAB - 1)
    cuts = np.cumsum(lens)[:-1]
    ends = rng.choice([".", ".", ".", "?", "!"], n)
    commas = rng.random(n) < 0.4
    quotes = rng.random(n) < 0.1
    src, tgt = [], []
    for k, sent in enumerate(np.split(ids, cuts)):
        i = start + k
        count = [i % COUNTER, i // COUNTER % COUNTER, i // COUNTER ** 2]
        s = [counter_src[c] for c in count] + [src_words[w] for w in sent]
        t = [counter_tgt[c] for c in count] + [tgt_words[w] for w in sent]
        if len(t) > 3:  # the target's order differs a little
            t[-1], t[-2] = t[-2], t[-1]
        if commas[k] and len(s) > 6:
            s[len(s) // 2] += " ,"
            t[len(t) // 2] += " ,"
        if quotes[k]:
            s[-1], t[-1] = f"“{s[-1]}”", f"«{t[-1]}»"
        src.append(" ".join(s).capitalize() + ends[k])
        tgt.append(" ".join(t).capitalize() + ends[k])
    return src, tgt


def generate(pairs: int, out: str, src_lang: str = "en", tgt_lang: str = "de", seed: int = 1,
             verbose: bool = True) -> tuple[str, str]:
    rng = np.random.default_rng(seed)
    vocab_src = words(rng, VOCAB + COUNTER, "bcdfghklmnprstvwz", "aeiou")
    vocab_tgt = words(rng, VOCAB + COUNTER, "bdfgjklmnprstxz", "aeiouäöü")
    src_words, counter_src = vocab_src[:VOCAB], vocab_src[VOCAB:]
    tgt_words, counter_tgt = vocab_tgt[:VOCAB], vocab_tgt[VOCAB:]
    os.makedirs(out, exist_ok=True)
    paths = (os.path.join(out, f"train.{src_lang}"), os.path.join(out, f"train.{tgt_lang}"))
    with open(paths[0], "w", encoding="utf-8", newline="\n") as fs, \
            open(paths[1], "w", encoding="utf-8", newline="\n") as ft, \
            tqdm(total=pairs, unit="pair", unit_scale=True, desc="synth", disable=not verbose) as bar:
        for start in range(0, pairs, BLOCK):
            s, t = block(rng, start, min(BLOCK, pairs - start), src_words, tgt_words, counter_src, counter_tgt)
            fs.writelines(x + "\n" for x in s)
            ft.writelines(x + "\n" for x in t)
            bar.update(len(s))
    return paths


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m tools.synth_corpus", description=__doc__.split("\n\n")[0])
    add_version(ap)
    ap.add_argument("--pairs", type=positive_int, required=True, help="pairs to write")
    ap.add_argument("--out", required=True, help="directory for train.SRC and train.TGT")
    ap.add_argument("--src-lang", default="en", help="source language code: the source file's suffix")
    ap.add_argument("--tgt-lang", default="de", help="target language code")
    ap.add_argument("--seed", type=nonneg_int, default=1)
    a = ap.parse_args(argv)
    # the codes name the files, as prepare reads them back: two distinct codes of 2-3 letters
    if not all(re.fullmatch(r"[A-Za-z]{2,3}", x) for x in (a.src_lang, a.tgt_lang)) or a.src_lang == a.tgt_lang:
        refuse(f"--src-lang {a.src_lang!r} and --tgt-lang {a.tgt_lang!r}: two distinct codes of 2-3 letters")
    if why := out_dir_error("--out", a.out):
        refuse(why)
    for p in generate(a.pairs, a.out, a.src_lang, a.tgt_lang, a.seed):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
