"""prepare(): corpus -> cleaned splits + joint SentencePiece model, cached by a hash of everything that shapes them."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from decoder import durable

from .clean import clean_pairs, normalise, normaliser_settings
from .corpus import (BIBLE_DEV_BOOK, BIBLE_MODULES, BIBLE_TEST_BOOK, DataError,
                     extract_bible, read_lines, read_parallel, write_lines)

FORMAT = 1  # bump when the output changes for the same inputs, so old caches are not reused
SPLITS = ("train", "dev", "test")
HELD_OUT_MAX = 1000  # dev and test size for a seeded split: 5% of the corpus, at most this


@dataclasses.dataclass
class Prepared:
    dir: str
    src_lang: str
    tgt_lang: str
    spm_model: str
    normaliser: dict
    splits: dict      # split -> (src_path, tgt_path); raw text, normalise when encoding
    counts: dict
    cache_hit: bool = False
    held_out: dict = dataclasses.field(default_factory=dict)  # split -> where its pairs come from

    def read(self, split: str, normalised: bool = False) -> tuple[list[str], list[str]]:
        sides = []
        for path, lang in zip(self.splits[split], (self.src_lang, self.tgt_lang)):
            lines = read_lines(path)[0]
            sides.append([normalise(x, lang, self.normaliser) for x in lines] if normalised else lines)
        return sides[0], sides[1]


def default_data_dir() -> str:
    if os.environ.get("KIT_DATA_DIR"):
        return os.environ["KIT_DATA_DIR"]
    repo = Path(__file__).resolve().parents[2]
    return str(repo / "data" if (repo / "pyproject.toml").exists() else Path.cwd() / "data")


def spm_options(vocab_size: int) -> dict:
    # ids fixed to the M2M100/fairseq layout: the model-dir contract relies on them
    return dict(vocab_size=vocab_size, model_type="unigram", character_coverage=0.9999,
                byte_fallback=True, bos_id=0, pad_id=1, eos_id=2, unk_id=3,
                bos_piece="<s>", pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
                input_sentence_size=2_000_000, shuffle_input_sentence=True)


def prepare(corpus: str = "bible-en-es", *, src: str | None = None, tgt: str | None = None,
            src_lang: str | None = None, tgt_lang: str | None = None,
            dev_src: str | None = None, dev_tgt: str | None = None,
            test_src: str | None = None, test_tgt: str | None = None,
            vocab_size: int = 8000, max_words: int = 200, min_ratio: float = 0.3,
            max_ratio: float = 2.0, seed: int = 1, data_dir: str | None = None,
            verbose: bool = True) -> Prepared:
    """Clean and split a corpus and train its SentencePiece model, or reuse the cached result.

    corpus: "bible-en-es" (embedded; "bible-es-en" for the other direction), or with
    src/tgt given, a name for the user's files. Raises DataError on bad input.
    """
    log = _logger(verbose)
    data_dir = os.path.abspath(data_dir or default_data_dir())
    held_out = _held_out_files(dev_src, dev_tgt, test_src, test_tgt)
    if src or tgt:
        inputs = _user_inputs(corpus, src, tgt, src_lang, tgt_lang, held_out)
    else:
        inputs = _bible_inputs(corpus, src_lang, tgt_lang, data_dir, verbose, held_out)
    name, s_lang, t_lang, files = inputs
    norm = normaliser_settings(s_lang, t_lang)
    options = dict(format=FORMAT, langs=[s_lang, t_lang], max_words=max_words, min_ratio=min_ratio,
                   max_ratio=max_ratio, seed=seed, normaliser=norm, spm=spm_options(vocab_size))
    key = hashlib.sha256(json.dumps(
        [options, {role: file_digest(p) for role, p in files.items()}], sort_keys=True).encode())
    out = os.path.join(data_dir, "prepared", f"{name}-{key.hexdigest()[:12]}")

    if not os.path.isfile(os.path.join(out, "prepared.json")):
        t0 = time.time()
        # a concurrent run that got there first wins
        durable.write_dir(out, lambda tmp: _build(tmp, files, s_lang, t_lang, options, verbose), replace=False)
        log(f"prepared in {time.time() - t0:.1f} s: {out}")
        hit = False
    else:
        log(f"cache hit: {out}")
        hit = True
    prep = _load(out, hit)
    log(summary(prep))
    return prep


def summary(prep: Prepared) -> str:
    c = prep.counts
    removed = ", ".join(f"{rule} {n}" for rule, n in c["removed"].items())
    return (f"{prep.src_lang}-{prep.tgt_lang}: read {c['pairs_read']} pairs, "
            f"{c['invalid_utf8_lines']} lines with invalid UTF-8 replaced\n"
            f"cleaning train removed: {removed}; dev/test empty pairs removed: {c['dev_test_empty']}\n"
            f"splits: train {c['train']}, dev {c['dev']}, test {c['test']}\n"
            + "".join(f"{k}: {v}\n" for k, v in prep.held_out.items()) +
            f"sentencepiece: {prep.spm_model}")


def _user_inputs(corpus, src, tgt, src_lang, tgt_lang, held_out):
    files = {"src": src, "tgt": tgt}
    _check_pair(files, "src", "tgt")
    s_lang, t_lang = src_lang or _lang_from_name(src), tgt_lang or _lang_from_name(tgt)
    if not s_lang or not t_lang or s_lang == t_lang:
        raise DataError("give distinct --src-lang and --tgt-lang (could not tell them from the file names)")
    _check_files(files)
    name = corpus if corpus and corpus != "bible-en-es" else Path(src).name.split(".")[0]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}-{s_lang}-{t_lang}")
    return name, s_lang, t_lang, {**{k: os.path.abspath(v) for k, v in files.items() if v}, **held_out}


def _held_out_files(dev_src, dev_tgt, test_src, test_tgt) -> dict:
    """The user's own dev and test pairs (e.g. a newstest), for any corpus: role -> absolute path."""
    files = {"dev_src": dev_src, "dev_tgt": dev_tgt, "test_src": test_src, "test_tgt": test_tgt}
    for split in ("dev", "test"):
        _check_pair(files, f"{split}_src", f"{split}_tgt")
    _check_files(files)
    return {k: os.path.abspath(v) for k, v in files.items() if v}


def _check_pair(files: dict, a: str, b: str) -> None:
    if bool(files[a]) != bool(files[b]):
        raise DataError(f"--{a.replace('_', '-')} and --{b.replace('_', '-')} go together")


def _check_files(files: dict) -> None:
    for k, path in files.items():
        if path and not os.path.isfile(path):
            what = "is a directory, not a file" if os.path.isdir(path) else "no such file"
            raise DataError(f"--{k.replace('_', '-')} {path}: {what}")


def held_out_origin(files: dict, book: bool = False) -> dict:
    """Where the dev and test pairs come from, in words: the report names its test set."""
    auto = "a held-out Bible book" if book else f"a seeded random slice of the corpus (5%, at most {HELD_OUT_MAX} pairs)"
    return {split: (f"{files[split + '_src']} / {files[split + '_tgt']}" if split + "_src" in files else auto)
            for split in ("dev", "test")}


def _lang_from_name(path: str) -> str | None:
    # corpus.de, corpus.de.gz -> "de"
    parts = Path(path).name.split(".")
    parts = parts[:-1] if parts[-1] == "gz" else parts
    return parts[-1] if len(parts) > 1 and 2 <= len(parts[-1]) <= 3 and parts[-1].isalpha() else None


def _bible_inputs(corpus, src_lang, tgt_lang, data_dir, verbose, held_out):
    m = re.fullmatch(r"bible-(\w+)-(\w+)", corpus or "")
    if not m or {m[1], m[2]} != set(BIBLE_MODULES):
        raise DataError(f"unknown corpus {corpus!r}: use bible-en-es, bible-es-en, or --src/--tgt files")
    if (src_lang or m[1], tgt_lang or m[2]) != (m[1], m[2]):
        raise DataError(f"{corpus} is {m[1]}->{m[2]}, not {src_lang}->{tgt_lang}")
    raw = extract_bible(os.path.join(data_dir, "bible-en-es"), verbose)
    files = {"src": f"{raw}/{m[1]}.txt", "tgt": f"{raw}/{m[2]}.txt", "book": f"{raw}/book.txt"}
    return corpus, m[1], m[2], {**files, **held_out}


def file_digest(path: str) -> str:
    """sha256 of a file's bytes (hex), read in blocks: corpora and models are large."""
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError as e:
        raise DataError(f"{path}: unreadable ({e.strerror or e})") from None


def _logger(verbose: bool):
    # progress goes to stderr: the CLI keeps stdout for the prepared dir alone
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else (lambda msg: None)


def _build(out: str, files: dict, s_lang: str, t_lang: str, options: dict, verbose: bool) -> None:
    pairs, bad = read_parallel(files["src"], files["tgt"])
    held, train = {}, pairs
    for split in ("dev", "test"):
        if f"{split}_src" in files:
            held[split], b = read_parallel(files[f"{split}_src"], files[f"{split}_tgt"])
            bad += b
    if "book" in files:  # the Bible: split by book, so test verses are unseen
        books = read_lines(files["book"])[0]
        own = {"dev": BIBLE_DEV_BOOK, "test": BIBLE_TEST_BOOK}
        for split, book in own.items():
            held.setdefault(split, [p for p, b in zip(pairs, books) if b == book])
        train = [p for p, b in zip(pairs, books) if b not in own.values()]
    elif len(held) < 2:
        held, train = _seeded_split(pairs, held, options["seed"])

    n_held = sum(map(len, held.values()))
    # dev/test stay raw so BLEU is computed against the real references
    held = {k: [(s, t) for s, t in v if s and t] for k, v in held.items()}
    train, removed = clean_pairs(train, options["max_words"], options["min_ratio"], options["max_ratio"])
    kept = removed.pop("kept")
    if not kept:
        raise DataError(f"nothing left to train on after cleaning {len(pairs)} pairs "
                        f"(removed: {', '.join(f'{k} {n}' for k, n in removed.items())}); "
                        "check the files, --max-words and the ratio bounds")
    for split, p in held.items():
        if not p:
            raise DataError(f"the {split} split is empty")
    splits = {"train": train, **held}
    for split, p in splits.items():
        write_lines(f"{out}/{split}.{s_lang}", (s for s, _ in p))
        write_lines(f"{out}/{split}.{t_lang}", (t for _, t in p))

    _train_spm(out, train, s_lang, t_lang, options, verbose)
    counts = {"pairs_read": len(pairs), "invalid_utf8_lines": bad, "removed": removed,
              "dev_test_empty": n_held - sum(map(len, held.values())),
              **{k: len(v) for k, v in splits.items()}}
    meta = {"src_lang": s_lang, "tgt_lang": t_lang, "normaliser": options["normaliser"],
            "counts": counts, "options": options, "inputs": files,
            "held_out": held_out_origin(files, book="book" in files)}
    with open(f"{out}/prepared.json", "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2, ensure_ascii=False)


def _seeded_split(pairs, held, seed):
    """Dev/test drawn at random from the non-empty pairs for whichever of them the user did not give."""
    candidates = [i for i, (s, t) in enumerate(pairs) if s and t]
    random.Random(seed).shuffle(candidates)
    size = min(HELD_OUT_MAX, max(1, len(pairs) // 20))
    taken = set()
    for split in ("test", "dev"):
        if split not in held:
            idx = sorted(candidates[len(taken):len(taken) + size])
            held[split] = [pairs[i] for i in idx]
            taken.update(idx)
    return held, [p for i, p in enumerate(pairs) if i not in taken]


def _train_spm(out, train, s_lang, t_lang, options, verbose):
    import sentencepiece as spm
    path = f"{out}/spm-input.txt"
    write_lines(path, (normalise(x, lang, options["normaliser"])
                       for pair in tqdm(train, desc="normalising", unit="pair", disable=not verbose)
                       for x, lang in zip(pair, (s_lang, t_lang))))
    _logger(verbose)(f"training SentencePiece ({options['spm']['model_type']}, vocab {options['spm']['vocab_size']})")
    spm.set_random_generator_seed(options["seed"])
    try:
        spm.SentencePieceTrainer.train(input=path, model_prefix=f"{out}/spm", num_threads=2,
                                       minloglevel=2, **options["spm"])
    except RuntimeError as e:
        raise DataError(spm_failure(str(e), options["spm"]["vocab_size"])) from None
    os.remove(path)


def spm_failure(message: str, vocab_size: int) -> str:
    """SentencePiece's error in one line, with the --vocab-size that helps: it needs a
    piece for every character it keeps (too small a vocabulary: "Vocabulary size is
    smaller than required_chars. 20 vs 54") and refuses more pieces than the corpus
    yields ("Vocabulary size too high (100000). Please set it to a value <= 557.")."""
    first = (message.strip().splitlines() or ["no message"])[0]
    low = re.search(r"smaller than required_chars\. \d+ vs (\d+)", first)
    high = re.search(r"too high \(\d+\)\. Please set it to a value <= (\d+)", first)
    if low:
        need = int(low[1])
        return (f"SentencePiece training failed: --vocab-size {vocab_size:,} has fewer pieces than the {need:,} "
                f"this corpus' characters need (try a larger --vocab-size, at least {need:,})")
    if high:
        return (f"SentencePiece training failed: --vocab-size {vocab_size:,} is more pieces than this corpus "
                f"yields (try a smaller --vocab-size, at most {int(high[1]):,})")
    why = first.split("] ", 1)[-1]  # without "INTERNAL: src/trainer_interface.cc(638) [the check]"
    return f"SentencePiece training failed: {why} (--vocab-size {vocab_size:,})"


def _load(out: str, cache_hit: bool) -> Prepared:
    with open(os.path.join(out, "prepared.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    s, t = meta["src_lang"], meta["tgt_lang"]
    return Prepared(dir=out, src_lang=s, tgt_lang=t, spm_model=os.path.join(out, "spm.model"),
                    normaliser=meta["normaliser"], counts=meta["counts"], cache_hit=cache_hit,
                    held_out=meta.get("held_out", {}),
                    splits={k: (os.path.join(out, f"{k}.{s}"), os.path.join(out, f"{k}.{t}")) for k in SPLITS})
