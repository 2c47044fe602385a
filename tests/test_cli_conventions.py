"""The command lines follow the field's conventions: `python -m decoder` takes
-i/-o files, --beam-size/--max-batch-tokens/--batch-size (the old names still
work), and translates line by line at a terminal."""
import gzip
import os
import pty
import re
import select
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT, python_m_each
from fixture_model import make_model_dir

import decoder.__main__ as cli
from decoder import cliargs

ENV = dict(os.environ, PYTHONPATH=ROOT)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("conv") / "model", enc=1, dec=1, seed=2)


class FakeTranslator:
    """Records what the CLI asks of the library; translates by upper-casing."""
    made = []
    precision, device, pool = "fp32", "cpu", None
    plan = SimpleNamespace(summary=lambda precision: "greedy loop")  # what the settings line reads
    opts = SimpleNamespace(max_tokens=1536, max_sentences=512)

    def __init__(self, model_dir, **kw):
        self.kw = kw
        self.cfg = SimpleNamespace(arch=SimpleNamespace(max_positions=64))
        FakeTranslator.made.append(self)

    def translate_stream(self, lines):
        return (s.upper() for s in lines)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def fake(monkeypatch):
    FakeTranslator.made.clear()
    monkeypatch.setattr(cli, "Translator", FakeTranslator)
    return FakeTranslator.made


@pytest.mark.parametrize("flags,key,value", [
    (["--beam-size", "3"], "beam", 3), (["--beam", "3"], "beam", 3),
    (["--max-batch-tokens", "77"], "max_tokens", 77), (["--max-tokens", "77"], "max_tokens", 77),
    (["--batch-size", "9"], "max_sentences", 9), (["--max-sentences", "9"], "max_sentences", 9),
])
def test_field_names_and_old_names_reach_the_translator(fake, tmp_path, flags, key, value):
    (tmp_path / "in.txt").write_text("a\n")
    assert cli.main(["--model", "m", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "o"), *flags]) == 0
    assert fake[0].kw[key] == value


@pytest.mark.parametrize("flag", ["--beam-size", "--max-batch-tokens", "--batch-size"])
def test_new_names_refuse_out_of_range_values(flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--model", "m", flag, "0"])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_input_and_output_files_replace_stdin_and_stdout(fake, tmp_path, capsys):
    with gzip.open(tmp_path / "in.gz", "wb") as fh:  # gzipped input is read as such
        fh.write(b"one\r\n\ntwo")
    (tmp_path / "out.txt").write_text("previous\n")
    assert cli.main(["--model", "m", "--input", str(tmp_path / "in.gz"), "--output", str(tmp_path / "out.txt")]) == 0
    assert (tmp_path / "out.txt").read_bytes() == b"ONE\n\nTWO\n"
    assert capsys.readouterr().out == ""
    assert [p.name for p in tmp_path.iterdir()] != [] and not any(".tmp." in p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("which", ["input", "output"])
def test_unusable_input_or_output_path_is_one_error_line_before_loading(fake, tmp_path, capsys, which):
    paths = {"input": str(tmp_path / "in.txt"), "output": str(tmp_path / "out.txt")}
    (tmp_path / "in.txt").write_text("a\n")
    paths[which] = str(tmp_path / "missing" / "x.txt")
    assert cli.main(["--model", "m", "-i", paths["input"], "-o", paths["output"]]) == 2
    why = {"input": "no such file", "output": f"no such directory {tmp_path / 'missing'}"}[which]
    assert capsys.readouterr().err == f"error: --{which} {paths[which]}: {why}\n"
    assert fake == [] and not os.path.exists(tmp_path / "missing")


def test_a_failed_run_leaves_the_previous_output_file_whole(monkeypatch, tmp_path):
    class Failing(FakeTranslator):
        def translate_stream(self, lines):
            yield "first"
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(cli, "Translator", Failing)
    (tmp_path / "in.txt").write_text("a\nb\n")
    (tmp_path / "out.txt").write_text("previous\n")
    assert cli.main(["--model", "m", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt")]) == 1
    assert (tmp_path / "out.txt").read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]


@pytest.mark.parametrize("tty,input_,want", [
    (True, "-", {"chunk_lines": 1, "pipeline": False}),
    (False, "-", {"chunk_lines": cli.CHUNK_LINES}),
    (True, "file.txt", {"chunk_lines": cli.CHUNK_LINES}),  # a file is read in chunks whatever stdin is
])
def test_a_terminal_is_read_line_by_line(tty, input_, want):
    a = cli.parse_args(["--model", "m", "-i", input_])
    assert cli.reading_mode(a, SimpleNamespace(isatty=lambda: tty)) == want


def test_files_give_what_stdin_gives(model_dir, tmp_path):
    text = b"the man sees a dog\n\nthe cat has a house\n"
    (tmp_path / "in.txt").write_bytes(text)
    base = [sys.executable, "-m", "decoder", "--model", str(model_dir), "--threads", "1", "--beam-size", "2"]
    piped = subprocess.run(base, input=text, capture_output=True, env=ENV, cwd=ROOT, timeout=300)
    files = subprocess.run(base + ["-i", "in.txt", "-o", "out.txt"], capture_output=True, env=ENV,
                           cwd=tmp_path, timeout=300)
    assert files.returncode == 0 and files.stdout == b"", files.stderr.decode()
    assert (tmp_path / "out.txt").read_bytes() == piped.stdout and piped.stdout.count(b"\n") == 3


def test_typed_line_is_answered_before_the_next_is_typed(model_dir):
    """On a terminal, the first translation appears while stdin is still open
    (before: nothing until 20,000 lines or end of input)."""
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "decoder", "--model", str(model_dir), "--threads", "1"],
                         stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    os.close(follower)
    try:
        os.write(leader, b"the man sees a dog\n")
        ready, _, _ = select.select([p.stdout], [], [], 240)
        assert ready, "no translation before the end of input"
        assert p.stdout.readline().endswith(b"\n")
    finally:
        os.write(leader, b"\x04")  # ^D: end of input
        p.wait(timeout=60)
        os.close(leader)


# -- precision: one default, and a word of what ran ------------------------------------------

def test_cli_and_library_share_the_default_precision():
    import inspect
    from decoder import Translator
    library = inspect.signature(Translator.__init__).parameters["precision"].default
    assert cli.parse_args(["--model", "m"]).precision is library is None  # the device's, resolved once


def test_the_default_precision_is_the_fast_path_int8_on_cpu_with_an_int8_kernel_and_fp16_on_cuda(monkeypatch,
                                                                                              capsys):
    """`python -m decoder --device cuda` ran fp32 (TF32): 72k words/s on the H100 where fp16 went 107k;
    on CPU the default ran fp32, 4.0x slower than the container's int8 on an AVX2-only CPU."""
    import torch
    from decoder import translator
    from decoder.translator import resolve_device_precision
    for kernel, want in ((True, "int8"), (False, "fp32")):
        monkeypatch.setattr(translator, "fbgemm_available", lambda: kernel)
        monkeypatch.setattr(translator, "int_mm_vnni", lambda: kernel)
        assert resolve_device_precision("cpu", None) == ("cpu", want)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device_precision("cuda", None) == ("cuda", "fp16")
    assert resolve_device_precision("cuda:1", "fp32") == ("cuda:1", "fp32")  # asked for: kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device_precision("cuda", None) == ("cpu", "fp32")  # the CPU's default where CUDA is not
    assert "running on CPU" in capsys.readouterr().err


def test_cli_default_output_is_the_library_default_output_and_says_what_ran(model_dir):
    """Before, the CLI ran `auto` (int8 on this kind of CPU) and the library fp32, with no word."""
    import torch
    from decoder import Translator, fused
    lines = ["the man sees a dog", "Él was old.", "a", "the king said unto them , the land"]
    r = subprocess.run([sys.executable, "-m", "decoder", "--model", str(model_dir), "--threads", "1"],
                       input="".join(x + "\n" for x in lines).encode(), capture_output=True, env=ENV, cwd=ROOT,
                       timeout=300)
    default = Translator(model_dir, threads=1)
    assert r.stdout.decode().split("\n")[:-1] == default.translate(lines)
    isa = torch.backends.cpu.get_cpu_capability()
    err = r.stderr.decode().splitlines()
    assert len(err) == 1 and err[0].startswith(f"decoder: precision {default.precision} (the default"), err
    assert f"1 thread, cpu ISA {isa}" in err[0] and fused.describe() in err[0], err
    # the plan as resolved for the CPU, and the CPU's batch sizes
    assert "; greedy loop, incremental state, one-row state at 1 sentence, CUDA graphs off, host reads every " \
           "step" in err[0] and err[0].endswith("; batches 1536 tokens x 512"), err


@pytest.mark.parametrize("command", [["-m", "decoder", "--threads", "2", "--precision", "auto"],
                                     ["-m", "submission.container.serve", "--hardware", "CPU-1", "--task", "latency"]],
                         ids=["decoder", "serve"])
def test_settings_line_is_printed_once_and_quiet_silences_it(model_dir, command):
    argv = [sys.executable, *command, "--model", str(model_dir)]
    loud = subprocess.run(argv, input=b"the dog\n", capture_output=True, env=ENV, cwd=ROOT, timeout=300)
    quiet = subprocess.run(argv + ["--quiet"], input=b"the dog\n", capture_output=True, env=ENV, cwd=ROOT,
                           timeout=300)
    err = loud.stderr.decode().splitlines()
    assert len(err) == 1 and err[0].startswith("decoder: precision ") and "(the default" in err[0], err
    assert " ISA " in err[0] and "thread" in err[0]
    assert quiet.returncode == 0 and quiet.stderr == b"" and quiet.stdout == loud.stdout


# -- one vocabulary across the tools -----------------------------------------------------------

def test_bench_and_evaluate_speak_the_vocabulary_and_keep_the_old_names():
    from submission.evaluate.__main__ import parse_args as evaluate_args
    from tools.bench import out_prefix, parse_args as bench_args
    new = bench_args(["--src", "x.en", "--repeat-input", "3", "--passes", "2", "--max-batch-tokens", "99",
                      "--out", "o/p"])
    old = bench_args(["--input", "x.en", "--repeat", "3", "--passes", "2", "--max-tokens", "99",
                      "--out-dir", "o", "--name", "p"])
    for a in (new, old):
        assert (a.src, a.repeat, a.passes, a.max_tokens, out_prefix(a)) == ("x.en", 3, 2, 99, os.path.join("o", "p"))
    new = evaluate_args(["--passes", "5", "--beam-size", "1,4", "--max-batch-tokens", "77"])
    old = evaluate_args(["--repeats", "5", "--beam", "1,4", "--max-tokens", "77"])
    for a in (new, old):
        assert (a.passes, a.beam, a.max_tokens) == (5, [1, 4], 77)


HELP = {"decoder": {"--beam-size": "(default: 1)", "--max-len-a": "(default: 1.5)"},
        "tools.bench": {"--passes": "(default: 1)", "--repeat-input": "(default: 1)"},
        "tools.bench_fused": {"--passes": "(default: 3)", "--against": "(default: plain)"},
        "tools.bench_workers": {"--passes": "(default: 3)", "--precision": "(default: int8)"},
        "student.shape_model": {"--seed": "(default: 0)"},
        "submission.evaluate": {"--passes": "(default: 3)"},
        "submission.image": {"--tag": "(default: wmt-kit:latest, on gpu wmt-kit-gpu:latest)"},
        "student.data prepare": {"--vocab-size": "(default: 8000)"},
        "student.train": {"--lr": "(default: 0.002 at 3072 tokens", "--dev-src": "newstest"},
        "student.train average": {"--last": "(default: 4)", "--run": "ckpt-", "--out": "checkpoint"},
        "student.distill": {"--student-lr": "on CPU 3072 tokens, lr 0.002"},
        "student.shortlist": {"--k": "(default 100)"}}


def option_blocks(text: str) -> dict:
    """--help text -> {option: its help block}."""
    blocks, name = {}, None
    for line in text.splitlines():
        s = line.strip()
        if line.startswith("  -") and not line.startswith("      "):
            name = [w.rstrip(",") for w in s.split() if w.startswith("--")][0]
            blocks[name] = s
        elif name and line.startswith("    ") and s:
            blocks[name] += " " + s
        else:
            name = None
    return blocks


@pytest.fixture(scope="module")
def helps() -> dict:
    """{command: [exit code, stdout]} of `python -m <command> --help`, each as `python -m` runs it."""
    commands = sorted(HELP)
    return dict(zip(commands, python_m_each([[*c.split(), "--help"] for c in commands], env=ENV)))


@pytest.mark.parametrize("command", sorted(HELP))
def test_help_names_the_command_and_says_each_default_once(helps, command):
    code, text, _ = helps[command]
    assert code == 0 and text.startswith(f"usage: python -m {command} "), text[:200]
    blocks = option_blocks(text)
    for option, block in blocks.items():
        assert block.count("(default") <= 1, block
        assert not any(f"(default: {d})" in block for d in ("None", "False", "[]")), block  # say nothing
    for option, want in HELP[command].items():
        assert want in blocks[option], blocks[option]


def parser_modules() -> dict[str, str]:
    """{`python -m` name: source} of every module that builds an argument parser."""
    out = {}
    for top in ("decoder", "student", "submission", "tools"):
        for d, dirs, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                path = os.path.join(d, n)
                if n.endswith(".py") and "ArgumentParser(" in open(path).read():
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__main__")
                    out[name] = open(path).read()
    return out


PARSERS = parser_modules()
# every command and subcommand given an option none has, and a value out of range
USAGE_ERRORS = {**{m: [m, "--no-such-option"] for m in PARSERS if m != "decoder.cliargs"},
                "student.data prepare": ["student.data", "prepare", "--no-such-option"],
                "student.train average": ["student.train", "average", "--no-such-option"],
                "decoder --max-batch-tokens 0": ["decoder", "--model", "m", "--max-batch-tokens", "0"],
                "decoder --set fused_nrom=on": ["decoder", "--model", "m", "--set", "fused_nrom=on"]}
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny")
TOOLS = ("tools.bench", "tools.bench_fused", "tools.bench_workers", "tools.bench_gil")


def test_every_command_parses_its_arguments_with_the_kits_parser():
    # argparse's own prints its usage before the error: 60 lines for the decoder's options
    assert [m for m, text in PARSERS.items() if "argparse.ArgumentParser(" in text] == []
    # and argparse's own formatter says "(default: None)" after every option without one
    assert [m for m, text in PARSERS.items() if "ArgumentDefaultsHelpFormatter" in text] == ["decoder.cliargs"]


def test_every_numeric_option_is_range_checked():
    # a bare int or float takes 0, negatives, 1e300 and nan, to fail later in a traceback
    # or not at all (`--repeat 0` timed nothing); cliargs' range types refuse them in one line
    assert [m for m, text in PARSERS.items() if re.search(r"\btype=(int|float)\b", text)] == []


def test_the_kits_parser_says_defaults_that_mean_something_without_being_told():
    p = cliargs.ArgumentParser(prog="x")
    p.add_argument("--n", type=int, default=3, help="how many")
    p.add_argument("--spm", help="its model")
    p.add_argument("--force", action="store_true", help="replace it")
    blocks = {k: " ".join(v.split()) for k, v in option_blocks(p.format_help()).items()}
    assert (blocks["--n"], blocks["--spm"], blocks["--force"]) == ("--n N how many (default: 3)", "--spm SPM its model",
                                                                    "--force replace it")
    assert {"decoder", "student.train", "student.distill", "submission.evaluate", "tools.convert"} <= set(PARSERS)


@pytest.fixture(scope="module")
def usage_errors() -> dict:
    """{case: [exit code, stdout, stderr]}, each as `python -m` runs it."""
    return dict(zip(USAGE_ERRORS, python_m_each(list(USAGE_ERRORS.values()), env=ENV)))


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_a_usage_error_is_one_line_naming_the_command_and_its_help(usage_errors, case):
    code, out, err = usage_errors[case]
    prog = f"python -m {USAGE_ERRORS[case][0]}"
    assert (code, out, err.count("\n")) == (2, "", 1), err
    assert err.startswith(prog) and ": error: " in err and err.endswith(" --help)\n"), err
    if case.startswith("decoder --max"):
        assert err == f"{prog}: error: argument --max-batch-tokens: must be >= 1, got 0 (see {prog} --help)\n"
    if case.startswith("decoder --set"):  # a misspelt switch: the close names, before any model is loaded
        assert err.startswith(f"{prog}: error: argument --set: unknown switch or setting 'fused_nrom'; "
                              "did you mean fused_norm"), err


def test_a_tools_model_dir_or_input_that_is_not_there_is_one_error_line(tmp_path):
    src, model = os.path.join(FIXTURE, "test.en"), os.path.join(FIXTURE, "model")
    cases = {**{(m, "model"): [m, "--model", "/no/model", "--src", src] for m in TOOLS},
             **{(m, "src"): [m, "--model", model, "--src", "/no/in.en"] for m in TOOLS}}
    says = {"model": "error: --model /no/model: model dir does not exist\n",
            "src": "error: --src /no/in.en: no such file\n"}
    for (m, what), (code, out, err) in zip(cases, python_m_each(list(cases.values()), env=ENV)):
        assert (code, out, err) == (2, "", says[what]), (m, what)
    # --src given, --ref not: the references are --src's .es file, which is not there
    (tmp_path / "in.en").write_text("one\n")
    (code, out, err), = python_m_each([["tools.bench_fused", "--model", model, "--src", str(tmp_path / "in.en")]],
                                      env=ENV)
    assert (code, out, err) == (2, "", f"error: --ref {tmp_path / 'in.es'}: no such file\n")


def test_average_of_last_4_with_2_checkpoints_says_so(tmp_path, capsys):
    import torch
    from student.train.__main__ import main
    for step, value in ((100, 1.0), (200, 3.0)):
        torch.save({"model": {"w": torch.full((2,), value)}, "step": step}, tmp_path / f"ckpt-{step:07d}.pt")
    main(["average", "--run", str(tmp_path), "--last", "4", "--out", str(tmp_path / "avg.pt")])
    err = capsys.readouterr().err
    assert "has 2 step checkpoints, not 4" in err and "ckpt-0000100.pt, ckpt-0000200.pt" in err
    assert torch.load(tmp_path / "avg.pt", weights_only=True)["model"]["w"].tolist() == [2.0, 2.0]


def test_average_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys):
    from student.train.__main__ import main
    (tmp_path / "run").mkdir()
    out = ["--out", str(tmp_path / "avg.pt")]
    assert main(["average", "--run", str(tmp_path / "run"), *out]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'run'}: no ckpt-*.pt step checkpoints to average\n"
    (tmp_path / "run" / "ckpt-0000100.pt").write_bytes(b"not a checkpoint")
    assert main(["average", "--run", str(tmp_path / "run"), "--last", "1", *out]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'run' / 'ckpt-0000100.pt'}: "), err
    assert sorted(os.listdir(tmp_path)) == ["run"]
    # the command itself, as a shell sees it (the same path as every other entry point)
    r = subprocess.run([sys.executable, "-m", "student.train", "average", "--run", str(tmp_path / "none"), *out],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert (r.returncode, r.stdout, len(r.stderr.splitlines())) == (2, "", 1), r.stderr
    assert main(["--out", str(tmp_path / "o"), "--dev-src", "x.en"]) == 2  # and student.train's own
    assert "come in pairs" in capsys.readouterr().err


def test_a_truncated_gzip_input_is_one_error_line_and_no_output_file(fake, tmp_path, capsys):
    data = gzip.compress(b"".join(b"line %d\n" % i for i in range(5000)))
    (tmp_path / "cut.gz").write_bytes(data[:len(data) // 2])  # a download that stopped half way
    assert cli.main(["--model", "m", "-q", "-i", str(tmp_path / "cut.gz"), "-o", str(tmp_path / "out.txt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot read --input {tmp_path / 'cut.gz'} to its end"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gz"]
