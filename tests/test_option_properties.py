"""Property tests (Hypothesis): every numeric option of every entry point, drawn from extreme
values (0, negative, huge, inf, nan, 20-digit and 5,000-digit integers, 1e300), gives either
the right output or exactly one `error:` line and exit 2, never a traceback.

The numeric options are found in each entry point's own argparse parser (every option whose
type is a decoder/cliargs.py range), so an option added later is drawn too. `python -m
decoder` runs in process on the trained fixture (right line count or the error line);
student.train, student.distill, submission.evaluate and tools.convert go as far as their
option check, the one function each CLI calls before any work (`options`, tested below to
be what the CLI calls), and `/run.sh` runs as a process (its two words are its options).

Before: `--max-len-a 0 --max-len-b 0` (greedy and beam), `--length-penalty 400` with a beam,
`--max-len-a 1e300` and a 20-digit `--max-len-b` or `--no-repeat-ngram` were tracebacks
after the input was read.
"""
import argparse
import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")
INPUT = "and god said\n\nlet there be light\n"  # 3 lines, one of them empty

EXTREMES = ["0", "-0", "1", "2", "-1", "0.5", "1.5", "10", "64", "65", "1024", "65536", "65537",
            "2147483647", "2147483648", "99999999999999999999", "-99999999999999999999", "9" * 5000,
            "1e300", "-1e300", "1e-300", "inf", "-inf", "nan", "1e400", "0x10", "", " ", "one", "1,2"]
values = st.one_of(st.sampled_from(EXTREMES),
                   st.integers(-2**70, 2**70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr))
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def numeric_options(p: argparse.ArgumentParser) -> list[str]:
    """The options of `p` whose values are numbers checked by decoder/cliargs.py."""
    kinds = ("int_range", "float_range", "int_list")
    return sorted(a.option_strings[-1] for a in p._actions
                  if a.option_strings and getattr(a.type, "__name__", "") in kinds and a.help != argparse.SUPPRESS)


def outcome(fn, argv):
    """(status, error lines) of fn(argv): status is what fn returned, or SystemExit's code.
    Any other exception is a traceback the user would have seen: the test fails with it."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = fn(argv)
        except SystemExit as e:
            status = e.code
    return status, [x for x in err.getvalue().splitlines() if "error:" in x]


def refused_once(status, errors) -> bool:
    return status == 2 and len(errors) == 1


@contextlib.contextmanager
def torch_threads_kept():
    n = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(n)  # --threads sets the process' pool


# -- python -m decoder: the whole run, in process ---------------------------------------------

def decoder_parser():
    from decoder.__main__ import parser
    return parser()


def numeric_settings() -> list[str]:
    """The decoder's numeric settings as options: `--set=NAME`, drawn as `--set=NAME=VALUE`."""
    from decoder.__main__ import KNOBS
    return [f"--set={name}" for name, kind in KNOBS.items() if kind.__name__ in ("int_range", "float_range")]


DECODER_OPTIONS = numeric_options(decoder_parser()) + numeric_settings()


def test_the_decoder_numeric_options_are_all_drawn():
    assert {"--beam-size", "--threads", "--workers", "--max-batch-tokens", "--batch-size", "--set=chunk_lines",
            "--length-penalty", "--max-len-a", "--max-len-b", "--no-repeat-ngram"} <= set(DECODER_OPTIONS)


def decoder_value(option: str, value: str) -> str:
    # an accepted --workers N starts N processes of ~290 MB: drawn values above 2 that the
    # range accepts (3..256) stay out; the refused ones (-1, 257, 20 digits, nan) are drawn
    if option == "--workers":
        try:
            if 2 < int(value) <= 256:
                return "2"
        except ValueError:
            pass
    return value


@settings(max_examples=40, **SETTINGS)
@given(st.lists(st.tuples(st.sampled_from(DECODER_OPTIONS), values), min_size=1, max_size=3),
       st.sampled_from([[], ["--beam-size", "3"]]))
def test_decoder_gives_one_line_per_input_line_or_one_error_line(tmp_path_factory, drawn, beam):
    from decoder.__main__ import main
    d = tmp_path_factory.mktemp("decode")
    (d / "in.txt").write_text(INPUT)
    argv = ["--model", FIXTURE, "-q", "-i", str(d / "in.txt"), "-o", str(d / "out.txt"), *beam]
    for option, value in drawn:
        argv += [f"{option}={decoder_value(option, value)}"]
    with torch_threads_kept():
        status, errors = outcome(main, argv)
    if status == 0:
        out = (d / "out.txt").read_text()
        assert out.count("\n") == 3 and out.split("\n")[1] == "", (argv, out)
    else:
        assert refused_once(status, errors), (argv, status, errors)
        assert not (d / "out.txt").exists()


def accepted_extremes(parse, option: str) -> list[str]:
    """The EXTREMES values `parse([option=value])` accepts; each refused one must be one error line."""
    ok = []
    for v in EXTREMES:
        status, errors = outcome(parse, [f"{option}={v}"])
        if status != 2 and not errors:
            ok.append(v)
        else:
            assert refused_once(status, errors), (option, v, status, errors)
    return ok


def extreme_ends() -> dict[str, tuple[str, str]]:
    """Each decoder option's smallest and largest accepted extreme value."""
    from decoder.__main__ import parse_args
    ends = {}
    for o in DECODER_OPTIONS:
        ok = sorted(accepted_extremes(lambda argv: parse_args(["--model", FIXTURE, *argv]), o), key=float)
        ends[o] = (ok[0], decoder_value(o, ok[-1]))
    return ends


@pytest.mark.parametrize("end", [0, 1], ids=["smallest", "largest"])
def test_the_decoder_runs_with_every_option_at_its_smallest_or_largest_accepted_extreme(tmp_path, end):
    # all at once: --max-len-a 0 with --max-len-b 0; the largest length cap, n-gram size,
    # penalty and batch sizes together. The beam stays at 4 for the largest (64 beams over
    # the 1,023 steps the cap allows cost time, not a type), --workers at 2 (a process each).
    from decoder.__main__ import main
    (tmp_path / "in.txt").write_text(INPUT)
    argv = ["--model", FIXTURE, "-q", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt")]
    for o, pair in extreme_ends().items():
        argv.append(f"{o}={pair[end] if (o, end) != ('--beam-size', 1) else 4}")
    with torch_threads_kept():
        assert main(argv) == 0, argv
    assert (tmp_path / "out.txt").read_text().count("\n") == 3, argv


@pytest.mark.parametrize("extra", [[], ["--beam-size", "4"]], ids=["greedy", "beam"])
def test_a_length_cap_of_zero_gives_one_empty_line_per_input_line(tmp_path, extra):
    from decoder.__main__ import main
    (tmp_path / "in.txt").write_text(INPUT)
    argv = ["--model", FIXTURE, "-q", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt"),
            "--max-len-a", "0", "--max-len-b", "0", *extra]
    assert main(argv) == 0
    assert (tmp_path / "out.txt").read_text() == "\n\n\n"


@pytest.mark.parametrize("option,value", [("--length-penalty", "400"), ("--max-len-a", "1e300"),
                                          ("--max-len-b", "9" * 20), ("--no-repeat-ngram", "9" * 20),
                                          ("--threads", "9" * 20), ("--max-batch-tokens", "9" * 20)])
def test_the_values_that_crashed_the_decoder_are_one_error_line_naming_the_option(tmp_path, option, value):
    from decoder.__main__ import main
    (tmp_path / "in.txt").write_text(INPUT)
    status, errors = outcome(main, ["--model", FIXTURE, "-i", str(tmp_path / "in.txt"), "--beam-size", "4",
                                    option, value])
    assert refused_once(status, errors) and f"argument {option}: must be" in errors[0], errors


def test_the_library_refuses_what_the_cli_refuses():
    from decoder.translator import Options
    for bad in (dict(max_len_a=1e300), dict(max_len_b=10**20), dict(no_repeat_ngram=10**20),
                dict(length_penalty=400.0), dict(length_penalty=float("nan")), dict(beam=0), dict(max_tokens=0),
                dict(chunk_lines=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Options.make(**bad)
    Options.make(max_len_a=0.0, max_len_b=0)  # a cap of zero: empty outputs, by design


# -- the entry points that train, convert or measure: their option check ------------------------

def train_options(argv):
    from student.train.__main__ import options
    return options(argv)


def distill_options(argv):
    from student.distill.__main__ import options
    return options(argv)


def evaluate_options(argv):
    from submission.evaluate.__main__ import options
    return options(argv)


def train_parser():
    from student.train.__main__ import train_parser
    return train_parser()


def distill_parser():
    from student.distill.__main__ import parser
    return parser()


def evaluate_parser():
    from submission.evaluate.__main__ import parser
    return parser()


CHECKED = {"student.train": (train_options, train_parser, lambda d: ["--out", str(d / "run")]),
           "student.distill": (distill_options, distill_parser, lambda d: ["--runs-dir", str(d / "runs")]),
           "submission.evaluate": (evaluate_options, evaluate_parser, lambda d: ["--out", str(d / "eval")])}
OPTIONS = {name: numeric_options(parser()) for name, (_, parser, _) in CHECKED.items()}


def test_every_checked_entry_point_has_numeric_options_drawn():
    assert {"--max-batch-tokens", "--seed", "--lr", "--max-minutes", "--vocab-size"} <= set(OPTIONS["student.train"])
    assert {"--teacher-beam", "--shard-size", "--student-lr", "--vocab-size"} <= set(OPTIONS["student.distill"])
    assert {"--beam-size", "--threads", "--timeout", "--container-cpus"} <= set(OPTIONS["submission.evaluate"])


def fits(option: str, value: str) -> bool:
    """An accepted value fits the types the run hands it to (int32, a float far from overflow)."""
    if "," in value:
        return all(fits(option, v) for v in value.split(","))
    x = float(value)
    return x == x and abs(x) <= 2**31 - 1


@pytest.mark.parametrize("name", sorted(CHECKED))
def test_every_extreme_value_of_every_option_is_accepted_within_its_types_or_one_error_line(name, tmp_path):
    check, _, base = CHECKED[name]
    for o in OPTIONS[name]:
        for v in accepted_extremes(lambda argv: check(base(tmp_path) + argv), o):
            assert fits(o, v), (name, o, v)
    assert not os.listdir(tmp_path), "the option check did work"


@settings(max_examples=60, **SETTINGS)
@given(st.sampled_from(sorted(CHECKED)).flatmap(
    lambda name: st.tuples(st.just(name), st.lists(st.tuples(st.sampled_from(OPTIONS[name]), values),
                                                   min_size=1, max_size=3))))
def test_training_distillation_and_evaluation_options_are_accepted_or_one_error_line(tmp_path_factory, drawn):
    name, pairs = drawn
    check, _, base = CHECKED[name]
    d = tmp_path_factory.mktemp("opts")
    argv = base(d) + [f"{o}={v}" for o, v in pairs]
    status, errors = outcome(check, argv)
    if status == 2:
        assert len(errors) == 1, (argv, errors)
    else:  # accepted: every value fits the types the run hands it to
        assert status is not None and not errors, (argv, status, errors)
        assert all(fits(o, v) for o, v in pairs), pairs
    assert not os.listdir(d), "the option check did work"


@settings(max_examples=30, **SETTINGS)
@given(st.lists(st.sampled_from(["--to", "ct2", "hf", "--from-hf", "--force", "--quantization", "int8",
                                 "--spm", "--src-lang", "--tgt-lang", "9" * 20, "nan", "", "-1"]), max_size=5))
def test_convert_options_are_accepted_or_one_error_line(tmp_path_factory, words):
    from tools.convert.__main__ import options
    d = tmp_path_factory.mktemp("conv")
    status, errors = outcome(options, [*words, FIXTURE, str(d / "out")])
    assert (status == 2 and len(errors) == 1) or isinstance(status, argparse.Namespace), (words, status, errors)
    assert not os.listdir(d)


# -- each CLI calls its option check first ------------------------------------------------------

class Checked(Exception):
    pass


@pytest.mark.parametrize("module", ["student.train.__main__", "student.distill.__main__",
                                    "submission.evaluate.__main__", "tools.convert.__main__"])
def test_each_cli_calls_its_option_check_before_any_work(module, monkeypatch, tmp_path):
    import importlib
    mod = importlib.import_module(module)
    seen = []

    def check(argv):
        seen.append(argv)
        raise Checked
    monkeypatch.setattr(mod, "options", check)
    argv = ["--out", str(tmp_path / "x")] if "convert" not in module else ["--to", "hf", FIXTURE, str(tmp_path / "x")]
    with pytest.raises(Checked):
        mod.main(argv)
    assert seen == [argv] and not os.listdir(tmp_path)


# -- /run.sh: its two words, as a process -------------------------------------------------------

@settings(max_examples=3, **SETTINGS)
@given(st.lists(st.sampled_from(["CPU-1", "CPU-ALL", "GPU", "latency", "throughput", "0", "-1", "9" * 20,
                                 "nan", "", "cpu-1"]), max_size=3))
def test_run_sh_gives_one_line_per_input_line_or_one_usage_line(words):
    env = dict(os.environ, MODEL_DIR=FIXTURE, PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    r = subprocess.run(["sh", os.path.join(ROOT, "submission", "container", "run.sh"), *words],
                       input=INPUT.encode(), capture_output=True, env=env, cwd=ROOT, timeout=300)
    if r.returncode == 0:
        assert r.stdout.count(b"\n") == 3, (words, r.stderr[-2000:])
    else:
        err = r.stderr.decode().splitlines()
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith("usage: /run.sh"), (words, err)
