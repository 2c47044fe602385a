"""prepare(): corpus -> cleaned splits + joint SentencePiece model, cached by a hash of everything that shapes them."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from decoder import durable
from decoder.cliargs import out_dir_error
from decoder.modeldir import folder_name_error, language_error

from . import dedup
from .clean import Cleaner, normalise, normalise_pairs, normaliser_settings, screen
from .corpus import (BIBLE_DEV_BOOK, BIBLE_MODULES, BIBLE_TEST_BOOK, DataError, Lines, Parallel,
                     count_nonempty_pairs, decode_line, extract_bible, has_text, read_lines, read_parallel,
                     write_lines)
from .parallel import imap_ordered, workers
from .sample import Sample

FORMAT = 1  # bump when the output changes for the same inputs, so old caches are not reused
# a seeded dev/test split draws with random.sample over the non-empty pairs (format 1 shuffled
# all their indices: memory that grows with the corpus); in the key of seeded splits alone,
# so the Bible's prepared dir (split by book, output unchanged) keeps its name
SEEDED_DRAW = "random.sample"
SPLITS = ("train", "dev", "test")
HELD_OUT_MAX = 1000  # dev and test size for a seeded split: 5% of the corpus, at most this
CHUNK = 20_000       # pairs cleaned and deduplicated at a time (a pool task)
POOL_BYTES = 16 << 20  # smaller corpora clean in-process: starting workers would cost more
DEDUP_BOUND = dedup.BOUND  # pair hashes held in memory before a sorted run spills to disk
NORM_CHUNK = 2_000   # sample pairs per normalisation task
# SentencePiece's sample: the pairs spm_options' input_sentence_size (2M sentences) allows, and a
# byte bound, as its trainer's memory grows with the characters it holds
SPM_SAMPLE_PAIRS = 1_000_000
SPM_SAMPLE_BYTES = 64 << 20


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
    if min_ratio > max_ratio:
        raise DataError(f"--min-ratio {min_ratio:g} is above --max-ratio {max_ratio:g}: no pair could pass")
    data_dir = os.path.abspath(data_dir or default_data_dir())
    if why := out_dir_error("--data-dir", data_dir):
        raise DataError(why)
    check_names(corpus, src_lang, tgt_lang)
    held_out = _held_out_files(dev_src, dev_tgt, test_src, test_tgt)
    if src or tgt:
        inputs = _user_inputs(corpus, src, tgt, src_lang, tgt_lang, held_out)
    else:
        inputs = _bible_inputs(corpus, src_lang, tgt_lang, data_dir, verbose, held_out)
    name, s_lang, t_lang, files = inputs
    norm = normaliser_settings(s_lang, t_lang)
    options = dict(format=FORMAT, langs=[s_lang, t_lang], max_words=max_words, min_ratio=min_ratio,
                   max_ratio=max_ratio, seed=seed, normaliser=norm, spm=spm_options(vocab_size))
    if "book" not in files and not {"dev_src", "test_src"} <= set(files):
        options["seeded_draw"] = SEEDED_DRAW
    key = hashlib.sha256(json.dumps(
        [options, {role: file_digest(p) for role, p in files.items()}], sort_keys=True).encode())
    out = os.path.join(data_dir, "prepared", f"{name}-{key.hexdigest()[:12]}")

    for f in durable.remove_stale(os.path.dirname(out)):
        log(f"removed {f}: left by a prepare that was killed")
    if os.path.lexists(out) and not os.path.isfile(os.path.join(out, "prepared.json")):
        raise DataError(f"{out}: exists and is not a prepared corpus (no prepared.json); remove it")
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


def check_names(corpus: str | None, src_lang: str | None, tgt_lang: str | None) -> None:
    """DataError for a name that becomes part of a path and could leave its dir: a language
    code (train.<lang>) or a corpus name (prepared/<corpus>-...)."""
    for option, code in (("--src-lang", src_lang), ("--tgt-lang", tgt_lang)):
        if code is not None and (why := language_error(code)):
            raise DataError(f"{option} {why}")
    if corpus is not None and (why := folder_name_error(corpus)):
        raise DataError(f"corpus name {why}")


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
    """One streamed pass over the corpus: split, clean, deduplicate, write train and sample it
    for SentencePiece. Memory: the dev/test pairs, one chunk, the dedup bound and the sample."""
    held, bad = {}, 0
    for split in ("dev", "test"):  # the user's own dev/test: newstest-sized, read whole
        if f"{split}_src" in files:
            held[split], b = read_parallel(files[f"{split}_src"], files[f"{split}_tgt"])
            bad += b
    pairs = Parallel(files["src"], files["tgt"])
    own = {k: [] for k in ("dev", "test") if k not in held}
    cleaner = Cleaner(options["max_words"], options["min_ratio"], options["max_ratio"], f"{out}/.dedup",
                      DEDUP_BOUND)
    sample = Sample(SPM_SAMPLE_PAIRS, SPM_SAMPLE_BYTES, options["seed"])
    routes, total = _routes(pairs, files, held, options["seed"], verbose)
    n_workers = workers() if os.path.getsize(files["src"]) > POOL_BYTES else 1
    bad += _clean_train(out, (s_lang, t_lang), routes, total, own, cleaner, sample, n_workers, verbose)
    cleaner.close()
    n_own = sum(map(len, own.values()))
    held.update(own)
    n_pairs = pairs.src.n

    n_held = sum(map(len, held.values()))
    # dev/test stay raw so BLEU is computed against the real references
    held = {k: [(s, t) for s, t in v if s and t] for k, v in held.items()}
    removed = dict(cleaner.counts)
    kept = removed.pop("kept")
    if not kept:
        # a tiny corpus can go whole to the held-out splits: say so, or the counts read as all zero
        raise DataError(f"nothing left to train on: of {n_pairs} pairs read, {n_own} went to dev/test and "
                        f"cleaning removed {', '.join(f'{k} {n}' for k, n in removed.items())}; "
                        "check the files, --max-words and the ratio bounds")
    for split, p in held.items():
        if not p:
            raise DataError(f"the {split} split is empty")
    for split in ("dev", "test"):
        write_lines(f"{out}/{split}.{s_lang}", (s for s, _ in held[split]))
        write_lines(f"{out}/{split}.{t_lang}", (t for _, t in held[split]))

    _logger(verbose)(f"sentencepiece sample: {len(sample)} of {kept} train pairs ({sample.bytes / 1e6:.1f} MB)")
    spm_pairs = len(sample)
    _train_spm(out, sample.items(), s_lang, t_lang, options, verbose)
    counts = {"pairs_read": n_pairs, "invalid_utf8_lines": bad, "removed": removed,
              "dev_test_empty": n_held - sum(map(len, held.values())),
              "train": kept, **{k: len(v) for k, v in held.items()}, "spm_sample_pairs": spm_pairs}
    meta = {"src_lang": s_lang, "tgt_lang": t_lang, "normaliser": options["normaliser"],
            "counts": counts, "options": options, "inputs": files,
            "held_out": held_out_origin(files, book="book" in files)}
    with open(f"{out}/prepared.json", "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2, ensure_ascii=False)


def _clean_train(out: str, langs: tuple, routes, total: int, own: dict, cleaner: Cleaner, sample: Sample,
                 n_workers: int, verbose: bool) -> int:
    """The routed raw pairs a chunk at a time, decoded and screened over n_workers processes
    (results in order, so the output does not depend on their number): the train ones
    deduplicated, written and sampled for SentencePiece, the corpus' own dev/test ones kept in
    `own`. Returns the lines with invalid UTF-8."""
    s_lang, t_lang = langs
    bad = 0
    tasks = ((chunk, cleaner.limits) for chunk in _chunks(routes, CHUNK))
    with open(f"{out}/train.{s_lang}", "wb") as fs, open(f"{out}/train.{t_lang}", "wb") as ft, \
            tqdm(total=total, desc="cleaning", unit="pair", unit_scale=True, delay=1,
                 disable=not verbose) as bar:
        for n, b, screened, held in imap_ordered(_screen_chunk, tasks, n_workers):
            bad += b
            for split, p in held:
                own[split].append(p)
            src, tgt, sizes = cleaner.keep(screened)
            fs.writelines(x + b"\n" for x in src)
            ft.writelines(y + b"\n" for y in tgt)
            sample.add(list(zip(src, tgt)), sizes)
            bar.update(n)
    return bad


def _screen_chunk(task):
    """A pool task: (routed raw pairs, limits) -> (pairs, lines with invalid UTF-8, the train
    pairs screened (clean.screen), the dev/test ones as (split, stripped text pair))."""
    chunk, limits = task
    bad, train, held = 0, [], []
    for split, (a, b) in chunk:
        (s, bad_s), (t, bad_t) = decode_line(a), decode_line(b)
        bad += bad_s + bad_t
        if split == "train":
            train.append((s, t))
        elif split:
            held.append((split, (s, t)))
    return len(chunk), bad, screen(train, limits), held


def _routes(pairs, files: dict, held: dict, seed: int, verbose: bool):
    """(iterator of (split or None, raw pair) over the corpus, pair count if known already).

    The Bible is split by book, so test verses are unseen (a book whose split the user gave
    goes nowhere); other corpora give dev/test a seeded random draw of non-empty pairs for
    whichever of them the user did not give (a first pass counts them)."""
    if "book" in files:
        split_of = {BIBLE_DEV_BOOK: "dev", BIBLE_TEST_BOOK: "test"}
        books = iter(Lines(files["book"]))
        return ((None if split_of.get(b) in held else split_of.get(b, "train"), p)
                for p, b in zip(pairs.raw(), books)), None
    todo = [s for s in ("test", "dev") if s not in held]
    if not todo:
        return (("train", p) for p in pairs.raw()), None
    n, candidates = count_nonempty_pairs(files["src"], files["tgt"], verbose)
    size = min(HELD_OUT_MAX, max(1, n // 20))
    picks = random.Random(seed).sample(range(candidates), min(candidates, size * len(todo)))
    split_of = {}
    for k, split in enumerate(todo):
        split_of.update(dict.fromkeys(picks[k * size:(k + 1) * size], split))

    def routes():
        rank = 0  # among the non-empty pairs
        for s, t in pairs.raw():
            split = "train"
            if has_text(s) and has_text(t):
                split, rank = split_of.get(rank, "train"), rank + 1
            yield split, (s, t)
    return routes(), n


def _chunks(it, size: int):
    it = iter(it)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _train_spm(out, sample, s_lang, t_lang, options, verbose):
    """SentencePiece on the sample (every train pair when they fit its bounds: the Bible does),
    normalised over the cores, source and target of each pair in the corpus order."""
    import sentencepiece as spm
    path = f"{out}/spm-input.txt"
    tasks = ((sample[i:i + NORM_CHUNK], s_lang, t_lang, options["normaliser"])
             for i in range(0, len(sample), NORM_CHUNK))
    n_workers = workers() if len(sample) >= 4 * NORM_CHUNK else 1
    with open(path, "w", encoding="utf-8", newline="\n") as fh, \
            tqdm(total=len(sample), desc="normalising", unit="pair", disable=not verbose) as bar:
        for lines in imap_ordered(normalise_pairs, tasks, n_workers):
            fh.writelines(x + "\n" for x in lines)
            bar.update(len(lines) // 2)
    del sample
    _logger(verbose)(f"training SentencePiece ({options['spm']['model_type']}, vocab {options['spm']['vocab_size']})")
    spm.set_random_generator_seed(options["seed"])
    try:  # 2 threads whatever the cores: the model depends on the count (its E-step sums per thread)
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
