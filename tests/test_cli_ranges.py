"""Every numeric option of every entry point is range-checked at parse time: a bad value is
argparse's one error line naming the option, exit 2, before any model or corpus is touched
(`--chunk-lines 0` used to exit 0 with no output, `--beam 0` to raise a traceback and
`--beam 100000` to run for minutes)."""
import argparse
import os
import subprocess
import sys

import pytest

from decoder.cliargs import int_list, int_range, nonneg_float, positive_float

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# below a regular file: nothing can be created there, so an option that slipped
# through fails fast instead of preparing data or training in some real directory
NOWHERE = os.path.join(os.path.abspath(__file__), "nowhere")


def _decoder(argv):
    from decoder.__main__ import main
    return main(["--model", NOWHERE, *argv])


def _data(argv):
    from student.data.__main__ import main
    return main(["prepare", "--data-dir", NOWHERE, *argv])


def _train(argv):
    from student.train.__main__ import main
    return main(["--out", NOWHERE, *argv])


def _average(argv):
    from student.train.__main__ import main
    return main(["average", "--run", NOWHERE, "--out", os.path.join(NOWHERE, "x.pt"), *argv])


def _distill(argv):
    from student.distill.__main__ import main
    return main(["--runs-dir", NOWHERE, *argv])


def _shortlist(argv):
    from student.shortlist.__main__ import main
    return main(["--model", NOWHERE, "--src", NOWHERE, "--tgt", NOWHERE, *argv])


def _evaluate(argv):
    from submission.evaluate.__main__ import main
    return main(["--out", NOWHERE, *argv])


ENTRY_POINTS = {"decoder": _decoder, "student.data": _data, "student.train": _train,
                "student.train average": _average, "student.distill": _distill,
                "student.shortlist": _shortlist, "submission.evaluate": _evaluate}

BAD = [
    ("decoder", "--beam", "0"), ("decoder", "--beam", "-1"), ("decoder", "--beam", "100000"),
    ("decoder", "--beam", "two"), ("decoder", "--set", "chunk_lines=0"), ("decoder", "--chunk-lines", "-5"),
    ("decoder", "--threads", "0"), ("decoder", "--threads", "-1"), ("decoder", "--workers", "-1"),
    ("decoder", "--workers", "100000"), ("decoder", "--max-len-a", "-1"), ("decoder", "--max-len-a", "nan"),
    ("decoder", "--max-len-b", "-1"), ("decoder", "--max-tokens", "0"), ("decoder", "--max-sentences", "0"),
    ("decoder", "--no-repeat-ngram", "-1"), ("decoder", "--length-penalty", "inf"),
    ("student.data", "--vocab-size", "0"), ("student.data", "--max-words", "-1"),
    ("student.data", "--min-ratio", "-0.5"), ("student.data", "--max-ratio", "0"),
    ("student.data", "--seed", "-1"),
    ("student.train", "--max-tokens", "0"), ("student.train", "--max-sentences", "-2"),
    ("student.train", "--accum", "0"), ("student.train", "--lr", "0"), ("student.train", "--warmup", "0"),
    ("student.train", "--label-smoothing", "1.5"), ("student.train", "--clip-norm", "-1"),
    ("student.train", "--max-steps", "-1"), ("student.train", "--max-minutes", "-1"),
    ("student.train", "--eval-every", "-1"), ("student.train", "--keep-last", "-1"),
    ("student.train", "--vocab-size", "0"), ("student.train", "--dev-max", "-1"),
    ("student.train average", "--last", "0"),
    ("student.distill", "--shard-size", "0"), ("student.distill", "--teacher-beam", "0"),
    ("student.distill", "--student-beam", "100000"), ("student.distill", "--train-limit", "-1"),
    ("student.distill", "--vocab-size", "0"), ("student.distill", "--teacher-lr", "-1"),
    ("student.distill", "--teacher-warmup", "0"), ("student.distill", "--shortlist-k", "-1"),
    ("student.distill", "--max-tokens", "0"), ("student.distill", "--student-minutes", "-1"),
    ("student.shortlist", "--k", "0"), ("student.shortlist", "--frequent", "-1"),
    ("student.shortlist", "--max-lines", "-1"),
    ("submission.evaluate", "--beam", "0"), ("submission.evaluate", "--beam", "1,0"),
    ("submission.evaluate", "--beam", "1,x"), ("submission.evaluate", "--threads", "0"),
    ("submission.evaluate", "--repeats", "0"), ("submission.evaluate", "--lines", "-1"),
    ("submission.evaluate", "--container-cpus", "0"), ("submission.evaluate", "--timeout", "0"),
    ("submission.evaluate", "--max-tokens", "0"), ("submission.evaluate", "--warmup-lines", "-1"),
]


@pytest.mark.parametrize("entry,option,value", BAD, ids=[f"{e} {o} {v}" for e, o, v in BAD])
def test_out_of_range_option_is_one_argparse_error_exit_2(capsys, entry, option, value):
    with pytest.raises(SystemExit) as e:
        ENTRY_POINTS[entry]([f"{option}={value}"])
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and f"argument {option}" in err[0], err


def test_boundary_values_are_accepted():
    from decoder.__main__ import parse_args
    a = parse_args(["--model", "m", "--beam", "64", "--set", "chunk_lines=1", "--threads", "1", "--workers", "0",
                    "--max-len-a", "0", "--max-len-b", "0", "--no-repeat-ngram", "0", "--max-tokens", "1"])
    assert (a.beam, a.chunk_lines, a.workers, a.max_len_a, a.max_len_b) == (64, 1, 0, 0.0, 0)
    from submission.evaluate.__main__ import parse_args as eval_args
    a = eval_args(["--beam", "1, 4", "--threads", "2"])
    assert a.beam == [1, 4] and a.threads == [2]
    from student.distill.__main__ import parser
    a = parser().parse_args(["--shortlist-k", "0", "--train-limit", "0", "--teacher-beam", "1"])
    assert (a.shortlist_k, a.train_limit, a.teacher_beam) == (0, 0, 1)


def test_range_helpers():
    assert int_range(1, 3)("3") == 3 and nonneg_float("0") == 0.0 and int_list(1)("2,3") == [2, 3]
    for parse, text in ((int_range(1, 3), "4"), (int_range(1), "0"), (int_range(0), "1.5"),
                        (positive_float, "0"), (positive_float, "-inf"), (nonneg_float, "nan"),
                        (int_list(1), ""), (int_list(1), "1,,0")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_decoder_chunk_lines_0_is_refused_before_loading_the_model():
    # the model dir does not exist: the range error must come first, alone
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "decoder", "--model", NOWHERE, "--chunk-lines", "0"],
                       input=b"a\nb\nc\nd\n", capture_output=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr.decode() == ("python -m decoder: error: argument --chunk-lines: must be >= 1, got 0 "
                                 "(see python -m decoder --help)\n")
