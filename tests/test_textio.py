"""decoder.textio, the one line reader: \\n only, capped lines, and every reader of the kit using it."""
import io
import os
import subprocess
import sys
import tracemalloc

import pytest

from conftest import ROOT, toy_parallel
from decoder import textio

# every character str.splitlines() splits on, in UTF-8, none of them "\n"
ODD_BREAKS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


class Endless(io.RawIOBase):
    """`n` bytes of one character followed by `tail`, produced as read: the test itself holds no big line."""

    def __init__(self, n: int, tail: bytes = b""):
        self.left, self.tail = n, tail

    def readable(self):
        return True

    def readinto(self, buf):
        if self.left:
            k = min(len(buf), self.left)
            buf[:k] = b"x" * k
            self.left -= k
            return k
        k = min(len(buf), len(self.tail))
        buf[:k], self.tail = self.tail[:k], self.tail[k:]
        return k


def test_reader_splits_on_newline_only():
    text = "a" + "b".join(ODD_BREAKS) + "c\nsecond\r\n\nlast without newline"
    got = list(textio.read_lines(io.BytesIO(text.encode())))
    assert got == ["a" + "b".join(ODD_BREAKS) + "c", "second", "", "last without newline"]


def test_reader_replaces_invalid_utf8_and_keeps_the_line():
    assert list(textio.read_lines(io.BytesIO(b"ok\n\xff\xfe bad\n"))) == ["ok", "\ufffd\ufffd bad"]


def test_reader_on_a_huge_line_returns_the_capped_prefix_and_keeps_the_following_lines():
    cut = []
    stream = io.BufferedReader(Endless(20_000_000, b"\nnext\nlast"))
    tracemalloc.start()
    got = list(textio.split_lines(stream, max_bytes=1000, on_cut=cut.append))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == [b"x" * 1000, b"next", b"last"]
    assert cut == [1]
    assert peak < 2_000_000  # the 20 MB line never is in memory whole


def test_reader_cap_keeps_a_line_of_exactly_the_cap_and_whole_characters():
    assert list(textio.split_lines(io.BytesIO(b"abcd\nabcde\n"), max_bytes=4)) == [b"abcd", b"abcd"]
    line = ("é" * 10).encode()  # 2 bytes a character: a cap of 5 would split the third
    assert list(textio.read_lines(io.BytesIO(line), max_bytes=5)) == ["éé"]


def test_reader_warns_once_naming_the_first_cut_line(capsys):
    data = b"short\n" + b"y" * 50 + b"\nshort\n" + b"z" * 50 + b"\n"
    assert list(textio.read_lines(io.BytesIO(data), max_bytes=10)) == ["short", "y" * 10, "short", "z" * 10]
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "input line 2 is longer than 10 bytes" in err


def test_line_cap_is_a_generous_multiple_of_the_model_positions():
    assert textio.line_cap(1024) == 256 * 1024


@pytest.fixture
def odd_file(tmp_path):
    p = tmp_path / "odd.txt"
    p.write_bytes("one\u2028still one\nline\x85two\r\nthree \x1c\n".encode("utf-8") + b"\xffbad\n")
    return str(p)


def test_every_reader_of_the_kit_gives_the_same_lines(odd_file):
    from student.data import read_lines
    from student.distill.shards import read_shard
    from submission.evaluate.testsets import _read
    want = ["one\u2028still one", "line\x85two", "three \x1c", "\ufffdbad"]
    assert textio.read_file(odd_file) == want
    assert _read(odd_file) == want
    assert read_shard(odd_file) == want
    assert read_lines(odd_file) == ([s.strip() for s in want], 1)


def test_trainer_pairs_stay_aligned_with_a_u2028_inside_a_line(tmp_path, monkeypatch):
    """str.splitlines() split each side once more: equal counts, every pair in between shifted."""
    from student.train.trainer import Corpus, TrainConfig
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))
    src, tgt = toy_parallel(200)
    (tmp_path / "c.en").write_text("\n".join(src) + "\n", encoding="utf-8")
    (tmp_path / "c.es").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    dsrc, dtgt = src[:50], tgt[:50]
    dsrc[0] = dsrc[0].replace(" ", " \u2028 ", 1)
    dtgt[40] = dtgt[40].replace(" ", " \u2028 ", 1)
    (tmp_path / "d.en").write_text("\n".join(dsrc) + "\n", encoding="utf-8")
    (tmp_path / "d.es").write_text("\n".join(dtgt) + "\n", encoding="utf-8")
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), src=str(tmp_path / "c.en"), tgt=str(tmp_path / "c.es"),
                      src_lang="en", tgt_lang="es", vocab_size=320, train_src=str(tmp_path / "d.en"),
                      train_tgt=str(tmp_path / "d.es"))
    os.makedirs(cfg.out_dir)
    c = Corpus(cfg, verbose=False)
    eos = c.sp.eos_id()
    assert [c.train["src"][i].tolist() for i in range(len(c.train))] == \
        [ids + [eos] for ids in c.sp.encode([c.norm_src(s) for s in dsrc])]
    assert [c.train["tgt"][i].tolist() for i in range(len(c.train))] == \
        [ids + [eos] for ids in c.sp.encode([c.norm_tgt(t) for t in dtgt])]


def test_shard_without_its_final_newline_is_incomplete_and_translated_again(tmp_path):
    from student.distill.shards import assemble, missing_shards, shard_path, translate_shards, write_atomic
    d = str(tmp_path)
    src = [f"LINE {i}" for i in range(25)]
    write_atomic(shard_path(d, 0), src[:10])
    write_atomic(shard_path(d, 1), src[10:20])
    with open(shard_path(d, 2), "w") as fh:  # cut inside its last line: 'LINE 24' became 'LINE '
        fh.write("\n".join(src[20:24]) + "\nLINE ")
    assert missing_shards(d, 25, 10) == [2]
    with pytest.raises(RuntimeError, match="shard-00002.txt: shard incomplete"):
        assemble(d, 25, 10)

    class Echo:
        def translate(self, lines, where=""):
            return list(lines)
    assert translate_shards(Echo(), src, d, 10, verbose=False)["translated_shards"] == 1
    assert assemble(d, 25, 10) == src


def test_chunks_are_bounded_by_characters_and_yielded_when_full():
    from decoder.pipeline import chunks
    assert [len(c) for c in chunks(["ab"] * 7, 3, max_chars=100)] == [3, 3, 1]
    assert [len(c) for c in chunks(["x" * 40] * 5, 100, max_chars=100)] == [3, 2]

    def two_then_fail():
        yield from ["a", "b"]
        raise AssertionError("read past a full chunk")
    it = chunks(two_then_fail(), 2)
    assert next(it) == ["a", "b"]  # a pipe reader gets its chunk before the next line is asked for


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    from fixture_model import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("textio") / "model", enc=1, dec=1, seed=3,
                          max_positions=32)


def test_truncation_warning_names_the_line_in_the_whole_input(short_model, capsys):
    from decoder import Translator
    lines = ["the dog"] * 5 + [" ".join(["word"] * 100)] + ["a cat"]
    with Translator(short_model, precision="fp32", chunk_lines=2, max_len_a=0, max_len_b=3) as tr:
        assert len(tr.translate(lines)) == 7
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "input line 6 has" in err


def test_truncation_warning_names_the_line_when_workers_encode_the_chunk(short_model, capsys):
    """The workers encode shares of the chunk; the parent still names the line in the whole input."""
    from decoder import Translator
    lines = ["the dog"] * 80 + [" ".join(["word"] * 100)] + ["a cat"] * 9
    with Translator(short_model, precision="fp32", workers=2, max_len_a=0, max_len_b=3) as tr:
        assert len(tr.translate(lines)) == 90
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "input line 81 has" in err, err


def test_cli_memory_does_not_grow_with_one_line_length():
    """A 20 MB line costs about what a short line costs: it is read in bounded pieces and
    dropped (before, the whole line was normalised and tokenised: 10 MB took the CLI
    from 260 to 562 MB with this model)."""
    model = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")
    code = ("import resource, subprocess, sys\n"
            "data = sys.stdin.buffer.read()\n"
            "r = subprocess.run([sys.executable, '-m', 'decoder', '--model', sys.argv[1], '--threads', '1',\n"
            "                    '--max-len-a', '0', '--max-len-b', '3'], input=data, capture_output=True)\n"
            "assert r.returncode == 0, r.stderr\n"
            "print(r.stdout.count(b'\\n'), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)\n")

    def lines_and_rss_mb(stdin: bytes):
        env = dict(os.environ, PYTHONPATH=ROOT)
        r = subprocess.run([sys.executable, "-c", code, model], input=stdin, capture_output=True,
                           env=env, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        return [int(x) for x in r.stdout.split()]
    n_short, rss_short = lines_and_rss_mb(b"the word\nwas with god\n")
    n_long, rss_long = lines_and_rss_mb(b"the word\n" + b"and the word was with god " * 800_000 + b"\nlast\n")
    assert (n_short, n_long) == (2, 3)
    assert rss_long < rss_short + 80, (rss_short, rss_long)
