"""student.data: cleaning rules, normalisation, splits, SentencePiece cache, errors, CLI."""
import gzip
import os
import random
import subprocess
import sys

import pytest
import sentencepiece as spm

from student.data import DataError, clean_pairs, normalise, normaliser_settings, prepare
from student.data import corpus as corpus_mod
from student.data import pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EN = "the a man woman house dog cat sees has big small red green old new city king word".split()
ES = "el un hombre mujer casa perro gato ve tiene grande pequeño rojo verde viejo nuevo ciudad rey palabra".split()
VOCAB = 300  # 4 specials + 256 byte pieces + a few dozen from the toy text


def toy(n, seed=0):
    rng = random.Random(seed)
    idx = [[rng.randrange(len(EN)) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    return [" ".join(EN[i] for i in x) for x in idx], [" ".join(ES[i] for i in x) for x in idx]


def write(path, lines, gz=False):
    data = ("\n".join(lines) + "\n").encode("utf-8")
    path.write_bytes(gzip.compress(data) if gz else data)
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    src, tgt = toy(400)
    return write(tmp_path / "c.en", src), write(tmp_path / "c.es", tgt)


def prep(tmp_path, src, tgt, **kw):
    return prepare(src=src, tgt=tgt, data_dir=str(tmp_path / "data"), vocab_size=kw.pop("vocab_size", VOCAB),
                   verbose=False, **kw)


# cleaning rules: one rule per test, the others must not fire

def test_clean_drops_empty_pairs():
    kept, c = clean_pairs([("a b", "c d"), ("", "x"), ("x", "  "), ("", "")])
    assert kept == [("a b", "c d")] and c["empty"] == 3 and c["kept"] == 1
    assert sum(v for k, v in c.items() if k not in ("empty", "kept")) == 0


def test_clean_drops_control_chars_but_keeps_tabs():
    pairs = [("a\x07b", "c d"), ("a b", "c\x85d"), ("a\x00", "b"), ("a\tb", "c d")]
    kept, c = clean_pairs(pairs)
    assert kept == [("a\tb", "c d")] and c["control_chars"] == 3


def test_clean_drops_pairs_over_word_limit():
    long = " ".join(["w"] * 11)
    kept, c = clean_pairs([(long, long), ("w " * 10, "w " * 10)], max_words=10)
    assert c["too_long"] == 1 and c["kept"] == 1 and len(kept[0][0].split()) == 10


def test_clean_drops_length_ratio_outside_bounds():
    pairs = [("a b c d e f g", "x"), ("a", "w x y z"), ("a b", "x y z")]
    assert clean_pairs(pairs)[1]["ratio"] == 2  # 7.0 and 0.25 are out of [0.3, 2.0]
    assert clean_pairs(pairs, min_ratio=0.7, max_ratio=1.0)[1]["ratio"] == 3  # 2/3 too
    assert clean_pairs(pairs, min_ratio=0.1, max_ratio=10)[1]["ratio"] == 0


def test_clean_drops_exact_duplicates_only():
    pairs = [("a b", "c d"), ("a b", "c d"), ("a b", "c e"), ("a b", "c d")]
    kept, c = clean_pairs(pairs)
    assert kept == [("a b", "c d"), ("a b", "c e")] and c["duplicate"] == 2


# normalisation

def test_normalise_applies_moses_punctuation_rules():
    s = normaliser_settings("en", "es")
    assert normalise("He said “hello”  ,  world…", "en", s) == 'He said "hello" , world...'
    assert normalise("«Hola»  ¿qué tal? 1,5 ％", "es", s) == '"Hola" ¿qué tal? 1,5%'


def test_normaliser_settings_rebuild_the_same_sacremoses_call():
    # the decoder rebuilds the normaliser from config.json without importing student/
    from sacremoses import MosesPunctNormalizer
    s = normaliser_settings("en", "es")
    kwargs = {k: v for k, v in s.items() if k not in ("type", "src_lang", "tgt_lang")}
    text = "a\x07 “b” ‘c’ – d…  e"
    assert normalise(text, "en", s) == MosesPunctNormalizer(lang="en", **kwargs).normalize(text)


# prepare: splits, cache, SentencePiece

def test_second_prepare_is_cache_hit_and_does_not_retrain(tmp_path, corpus):
    p1 = prep(tmp_path, *corpus)
    mtime = os.stat(p1.spm_model).st_mtime_ns
    p2 = prep(tmp_path, *corpus)
    assert (p1.cache_hit, p2.cache_hit) == (False, True)
    assert p2.dir == p1.dir and p2.counts == p1.counts
    assert os.stat(p2.spm_model).st_mtime_ns == mtime


def test_cache_key_covers_vocab_size_cleaning_options_and_file_content(tmp_path, corpus):
    base = prep(tmp_path, *corpus).dir
    assert prep(tmp_path, *corpus, vocab_size=VOCAB + 10).dir != base
    assert prep(tmp_path, *corpus, max_words=50).dir != base
    with open(corpus[0], "a") as fh, open(corpus[1], "a") as fh2:
        fh.write("new line\n"), fh2.write("nueva línea\n")
    assert prep(tmp_path, *corpus).dir != base


def test_spm_special_ids_are_fixed_and_any_text_encodes(tmp_path, corpus):
    sp = spm.SentencePieceProcessor(model_file=prep(tmp_path, *corpus).spm_model)
    assert [sp.id_to_piece(i) for i in range(4)] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert (sp.bos_id(), sp.pad_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)
    assert sp.get_piece_size() == VOCAB
    assert sp.unk_id() not in sp.encode("漢字 ☃ qxz")  # byte fallback


def test_seeded_split_is_disjoint_deterministic_and_sized(tmp_path, corpus):
    p = prep(tmp_path, *corpus)
    train, dev, test = (set(zip(*p.read(s))) for s in ("train", "dev", "test"))
    assert p.counts["dev"] == p.counts["test"] == 20  # 5% of 400
    assert not (dev & test) and not (train & dev) and not (train & test)
    p2 = prep(tmp_path / "other", *corpus)
    assert p2.read("dev") == p.read("dev")
    p3 = prep(tmp_path, *corpus, seed=2)
    assert p3.read("dev") != p.read("dev")


def test_dev_and_test_files_stay_raw_while_train_is_cleaned(tmp_path, corpus):
    raw = ["He said “hi”  ,  now", "", "“x”"]
    d = [write(tmp_path / f"dev.{l}", raw) for l in ("en", "es")]
    src, tgt = toy(100)
    p = prep(tmp_path, write(tmp_path / "t.en", src + ["dup a", "dup a"]),
             write(tmp_path / "t.es", tgt + ["dup b", "dup b"]),
             dev_src=d[0], dev_tgt=d[1], test_src=d[0], test_tgt=d[1])
    assert p.read("dev")[0] == ["He said “hi”  ,  now", "“x”"]  # only the empty pair went
    assert p.read("dev", normalised=True)[0][0] == 'He said "hi" , now'
    assert p.counts["dev_test_empty"] == 2 and p.counts["removed"]["duplicate"] == 1
    assert p.counts["train"] == p.counts["pairs_read"] - 1  # no seeded split when both are given


def test_gzip_input_gives_the_same_result_as_plain(tmp_path):
    src, tgt = toy(200)
    plain = prep(tmp_path, write(tmp_path / "p.en", src), write(tmp_path / "p.es", tgt))
    gz = prep(tmp_path, write(tmp_path / "g.en.gz", src, gz=True), write(tmp_path / "g.es.gz", tgt, gz=True))
    assert gz.src_lang == "en" and gz.tgt_lang == "es"  # taken from the names, past .gz
    assert gz.read("train") == plain.read("train") and gz.counts == plain.counts


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    src, tgt = toy(100)
    s = tmp_path / "u.en"
    s.write_bytes(("\n".join(src) + "\n").encode().replace(b"the", b"th\xff", 3))
    p = prep(tmp_path, str(s), write(tmp_path / "u.es", tgt))
    assert p.counts["invalid_utf8_lines"] == 3
    text = "\n".join(sum(map(list, (p.read(k)[0] for k in ("train", "dev", "test"))), []))
    assert text.count("th\ufffd") == 3


def test_mismatched_line_counts_error_names_both_counts(tmp_path):
    with pytest.raises(DataError, match=r"a\.en has 3 lines, .*b\.es has 2 lines"):
        prep(tmp_path, write(tmp_path / "a.en", ["x", "y", "z"]), write(tmp_path / "b.es", ["x", "y"]))


def test_everything_cleaned_away_is_a_clear_error(tmp_path):
    src = ["one two three four five six seven"] * 50
    with pytest.raises(DataError, match=r"nothing left to train on: of 50 pairs read, \d+ went to dev/test "
                                        r".*ratio [1-9]"):
        prep(tmp_path, write(tmp_path / "x.en", src), write(tmp_path / "x.es", ["uno"] * 50))


def test_a_corpus_too_small_for_a_train_split_says_it_went_to_dev_test(tmp_path):
    src, tgt = toy(2)
    with pytest.raises(DataError, match=r"of 2 pairs read, 2 went to dev/test and cleaning removed empty 0"):
        prep(tmp_path, write(tmp_path / "s.en", src), write(tmp_path / "s.es", tgt))


def test_a_min_ratio_above_the_max_ratio_is_refused_before_any_work(tmp_path):
    with pytest.raises(DataError, match=r"--min-ratio 3 is above --max-ratio 1\.5: no pair could pass"):
        prep(tmp_path, "missing.en", "missing.es", min_ratio=3, max_ratio=1.5)
    assert not (tmp_path / "data").exists()


def test_a_killed_build_leaves_no_cache_behind(tmp_path, corpus, monkeypatch):
    def killed(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(pipeline, "_train_spm", killed)
    with pytest.raises(KeyboardInterrupt):
        prep(tmp_path, *corpus)
    assert os.listdir(tmp_path / "data" / "prepared") == []
    monkeypatch.undo()
    assert not prep(tmp_path, *corpus).cache_hit


def test_missing_sword_modules_error_gives_apt_command(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "SWORD_PATH", str(tmp_path / "no-sword"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root: must not try to install
    with pytest.raises(DataError, match="apt-get install -y --no-install-recommends sword-text-web sword-text-sparv"):
        prepare("bible-en-es", data_dir=str(tmp_path / "data"), verbose=False)


# the real Bible (extracted once into the shared data/ cache, ~5 s the first time)

@pytest.mark.skipif(corpus_mod._missing_modules() != [], reason="sword-text-web/sparv not installed")
def test_bible_extraction_walks_spanish_books_and_splits_by_book():
    from student.data.pipeline import default_data_dir
    from student.data import read_lines
    d = corpus_mod.extract_bible(os.path.join(default_data_dir(), "bible-en-es"), verbose=False)
    en, es, books = (read_lines(f"{d}/{n}.txt")[0] for n in ("en", "es", "book"))
    assert len(en) == len(es) == len(books) == 31102
    assert books.count("Acts") == 1007 and books.count("Judges") == 618
    assert "Tobit" not in set(books) and len(set(books)) == 66
    assert en[0].startswith("In the beginning") and es[0].startswith("EN el principio")


# CLI

def run_cli(*args, data_dir):
    return subprocess.run([sys.executable, "-m", "student.data", "prepare", *args, "--data-dir", str(data_dir)],
                          capture_output=True, text=True, cwd=ROOT)


def test_cli_prints_counts_then_cache_hit_with_the_same_counts(tmp_path, corpus):
    args = ("--src", corpus[0], "--tgt", corpus[1], "--vocab-size", str(VOCAB))
    first, second = run_cli(*args, data_dir=tmp_path), run_cli(*args, data_dir=tmp_path)
    assert first.returncode == second.returncode == 0, first.stderr
    assert "splits: train 360, dev 20, test 20" in first.stderr
    assert "cleaning train removed: empty 0" in first.stderr and "cache hit" not in first.stderr
    assert "cache hit" in second.stderr
    assert first.stderr.splitlines()[-4:] == second.stderr.splitlines()[-4:]
    assert first.stdout == second.stdout and os.path.isdir(first.stdout.strip())


def test_cli_reports_bad_input_as_one_error_line_and_exit_2(tmp_path):
    r = run_cli("--src", write(tmp_path / "a.en", ["x"] * 3), "--tgt", write(tmp_path / "a.de", ["y"]),
                data_dir=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: line counts differ") and len(r.stderr.strip().splitlines()) == 1
