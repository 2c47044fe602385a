"""Training and conversion inputs are checked before any work, and a failure is one error
line: parallel files of different line counts (before: a ValueError traceback after 11 s of
corpus preparation), a failed run's empty --out (before: left behind), a SentencePiece
vocabulary too small for the corpus' characters (before: "try a smaller --vocab-size"), a
truncated model.safetensors given to tools.convert --from-hf (before: a SafetensorError
traceback), a --set the decoder could never load (before: a traceback after preparation)."""
import gzip
import os
import shutil

import pytest

from decoder.textio import count_lines, read_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")


def error_lines(capsys) -> list[str]:
    return [x for x in capsys.readouterr().err.splitlines() if "error:" in x]


@pytest.fixture
def no_training(monkeypatch):
    """Records whether student.train's main reached the trainer (nothing may run before the checks)."""
    import student.train.__main__ as cli
    calls = []

    def train(cfg):
        calls.append(cfg)
        raise AssertionError("the trainer started before the options were refused")
    monkeypatch.setattr(cli, "train", train)
    return calls


@pytest.mark.parametrize("pair", ["train", "dev", "test", ""])
def test_parallel_files_of_different_line_counts_are_one_error_line_before_any_work(
        tmp_path, capsys, no_training, pair):
    from student.train.__main__ import main
    (tmp_path / "a").write_text("one\ntwo\nthree\n")
    (tmp_path / "b").write_bytes(gzip.compress(b"uno\ndos"))  # gzipped, no final newline: 2 lines
    opt = f"--{pair}-" if pair else "--"
    assert main(["--out", str(tmp_path / "out"), f"{opt}src", str(tmp_path / "a"),
                 f"{opt}tgt", str(tmp_path / "b")]) == 2
    assert not no_training
    assert error_lines(capsys) == [f"error: {opt}src {tmp_path / 'a'} has 3 lines but {opt}tgt {tmp_path / 'b'} "
                                   f"has 2: the pairs must be line-aligned"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"", b"a", b"a\n", b"a\nb", b"a\r\nb\r\n", b"a\xe2\x80\xa8b\n\x0c\n",
                                     b"\n\n\n", b"x" * (3 << 20) + b"\ny"],
                         ids=["empty", "one-no-newline", "one", "two-no-newline", "crlf", "separators",
                              "blank", "3MiB-line"])
def test_line_count_is_the_readers_count(tmp_path, content):
    for name, data in (("plain", content), ("gz", gzip.compress(content))):
        (tmp_path / name).write_bytes(data)
        assert count_lines(str(tmp_path / name)) == len(read_file(str(tmp_path / name)))


@pytest.mark.parametrize("setting,message", [
    ("d_model=1e300", "architecture.d_model must be an integer"),
    ("d_model=99999999999999999999", "architecture.d_model must be in [1, 16,384]"),
    ("max_positions=1000000000", "architecture.max_positions must be in [2, 65,536]"),
    ("n_heads=3", "architecture.n_heads must divide d_model"),
    ("activation=swish", "architecture.activation"),
    ("dropout=1.5", "--set dropout: must be a number in [0, 1)"),
    ("dropuot=0.2", "--set dropuot: not a model field"),
])
def test_a_model_the_decoder_could_not_load_is_refused_before_any_work(tmp_path, capsys, no_training,
                                                                        setting, message):
    from student.train.__main__ import main
    assert main(["--out", str(tmp_path / "out"), "--set", setting]) == 2
    err = error_lines(capsys)
    assert not no_training and len(err) == 1 and message in err[0], err


def test_a_bad_init_from_model_dir_is_refused_before_any_work(tmp_path, capsys, no_training):
    from student.train.__main__ import main
    assert main(["--out", str(tmp_path / "out"), "--init-from", str(tmp_path / "nothing")]) == 2
    assert error_lines(capsys) == [f"error: --init-from {tmp_path / 'nothing'}: model dir does not exist"]
    assert not no_training


def tiny_corpus(tmp_path):
    src = [f"the house {i} of the king is big" for i in range(60)]
    tgt = [f"la casa {i} del rey es grande" for i in range(60)]
    (tmp_path / "c.en").write_text("\n".join(src) + "\n")
    (tmp_path / "c.es").write_text("\n".join(tgt) + "\n")
    return str(tmp_path / "c.en"), str(tmp_path / "c.es")


def test_a_vocabulary_too_small_for_the_characters_says_larger(tmp_path, capsys, monkeypatch):
    from student.data.__main__ import main
    src, tgt = tiny_corpus(tmp_path)
    assert main(["prepare", "--src", src, "--tgt", tgt, "--vocab-size", "10", "--data-dir", str(tmp_path / "d")]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "try a larger --vocab-size, at least " in err[0], err
    # and the size it names is one SentencePiece accepts for these characters
    need = int(err[0].rsplit("at least ", 1)[1].rstrip(")").replace(",", ""))
    assert main(["prepare", "--src", src, "--tgt", tgt, "--vocab-size", str(need),
                 "--data-dir", str(tmp_path / "d")]) == 0


def test_a_vocabulary_larger_than_the_corpus_yields_says_smaller(tmp_path, capsys):
    from student.data.__main__ import main
    src, tgt = tiny_corpus(tmp_path)
    assert main(["prepare", "--src", src, "--tgt", tgt, "--vocab-size", "5000", "--data-dir", str(tmp_path / "d")]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "try a smaller --vocab-size, at most " in err[0], err


def test_a_failed_train_leaves_no_empty_out_dir(tmp_path, capsys, monkeypatch):
    # a real failure after the trainer made --out: SentencePiece refuses the vocabulary
    from student.train.__main__ import main
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))
    src, tgt = tiny_corpus(tmp_path)
    assert main(["--out", str(tmp_path / "out"), "--src", src, "--tgt", tgt, "--vocab-size", "10"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "try a larger --vocab-size" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_failed_train_says_what_it_left_and_keeps_a_dir_it_did_not_make(tmp_path):
    from student.train.__main__ import tidy_out
    made = tmp_path / "made"
    made.mkdir()
    (made / "encoded-train.pt").write_bytes(b"x")
    assert tidy_out(str(made), created=True) == f" ({made} keeps 1 file of this run: the same command resumes)"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    assert tidy_out(str(theirs), created=False) == "" and theirs.is_dir()  # the user's own empty dir stays


def test_convert_from_hf_of_a_truncated_safetensors_is_one_error_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tools.convert.__main__ import main
    hf = tmp_path / "hf"
    assert main(["--to", "hf", FIXTURE, str(hf)]) == 0
    w = hf / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    capsys.readouterr()
    assert main(["--from-hf", str(hf), str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [x for x in err if not x.startswith("warning")]
    assert len(err) == 1 and err[0].startswith(f"error: {w}: unreadable weights ("), err
    assert not (tmp_path / "back").exists()


def test_a_truncated_model_safetensors_in_a_model_dir_is_one_error_line(tmp_path, capsys):
    from decoder.__main__ import main
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    (tmp_path / "in.txt").write_text("hello\n")
    assert main(["--model", str(d), "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --model {w}: unreadable safetensors ("), err
