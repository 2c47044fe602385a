"""`python -m decoder`: one output line per input line, whatever the bytes; bad model dirs;
a --help of the user's options, the switches behind --set and --list-switches."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from fixture_model import make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("cli") / "model", enc=1, dec=1, seed=2)


def run_cli(model, stdin: bytes, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "decoder", "--model", str(model), "--threads", "1", *args],
                          input=stdin, capture_output=True, env=env, cwd=ROOT, timeout=300)


def test_awkward_input_gives_one_line_per_input_line(model_dir):
    long_line = " ".join(["word"] * 5000)
    stdin = (b"the dog sees a cat\r\n"          # CRLF
             b"\n"                               # empty
             b"\xff\xfe\xc3( broken utf-8\n"     # invalid bytes
             + long_line.encode() + b"\n"        # over the model limit
             b"   \n"                            # blank
             b"\x00nul and \x1b escape\n"
             b"last line without newline")
    r = run_cli(model_dir, stdin, "--max-len-a", "0.1", "--max-len-b", "5")
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.split(b"\n")
    assert out[-1] == b"" and len(out) - 1 == 7
    assert out[1] == b"" and out[4] == b""
    out[0].decode("utf-8")  # always valid UTF-8
    assert r.stderr.decode().count("warning:") == 1


def test_empty_stdin_gives_empty_stdout(model_dir):
    r = run_cli(model_dir, b"")
    assert r.returncode == 0 and r.stdout == b""


def test_cli_greedy_matches_library(model_dir):
    from decoder import Translator
    lines = ["the man sees a dog", "Él was old.", "a"]
    r = run_cli(model_dir, "\n".join(lines).encode() + b"\n", "--precision", "fp32")
    assert r.stdout.decode().split("\n")[:-1] == Translator(model_dir, precision="fp32").translate(lines)


def test_cli_beam_matches_library_beam_not_greedy(model_dir):
    from decoder import Translator
    lines = ["the dog", "", "the cat sees", "the man sees a dog"]
    r = run_cli(model_dir, "\n".join(lines).encode() + b"\n", "--beam", "3", "--precision", "fp32")
    assert r.returncode == 0, r.stderr.decode()
    beam = Translator(model_dir, beam=3, precision="fp32").translate(lines)
    assert r.stdout.decode().split("\n")[:-1] == beam
    # on this model the beam finds other outputs than greedy: a CLI that fell back to greedy fails here
    assert beam != Translator(model_dir, precision="fp32").translate(lines)


def broken(model_dir, tmp_path, how):
    d = tmp_path / "broken"
    shutil.copytree(model_dir, d)
    cfg = d / "config.json"
    if how == "format_version":
        c = json.loads(cfg.read_text())
        c["format_version"] = 7
        cfg.write_text(json.dumps(c))
        return d, r"config.json: unknown format_version 7"
    if how == "missing":
        os.remove(d / "spm.model")
        return d, r"spm.model: missing file"
    if how == "shape":
        c = json.loads(cfg.read_text())
        c["architecture"]["ffn_dim"] += 4
        cfg.write_text(json.dumps(c))
        return d, r"model.safetensors: shape mismatch for encoder.layers.0.fc1.weight"
    if how == "corrupt":
        w = d / "model.safetensors"
        data = w.read_bytes()
        w.write_bytes(data[:8] + b"\x00garbage" + data[16:100])
        return d, r"model.safetensors: unreadable safetensors"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["format_version", "missing", "shape", "corrupt"])
def test_bad_model_dir_is_one_error_line_naming_the_file(model_dir, tmp_path, how):
    d, expected = broken(model_dir, tmp_path, how)
    r = run_cli(d, b"the dog\n")
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and r.stdout == b""
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


# -- --help: the user's options; the switches behind --set and --list-switches ------------------

USER_OPTIONS = ["--model", "--input", "--output", "--device", "--precision", "--beam-size", "--max-batch-tokens",
                "--batch-size", "--threads", "--workers", "--max-len-a", "--max-len-b", "--shortlist", "--quiet",
                "--version"]


def test_help_fits_in_60_lines_with_the_users_options_before_the_switches():
    """Before: 322 lines, 106 of them --x/--no-x pairs of ablation switches before --beam-size."""
    from decoder.optimisations import OPTIMISATIONS
    r = subprocess.run([sys.executable, "-m", "decoder", "--help"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT, COLUMNS="80"), cwd=ROOT, timeout=120)
    assert r.returncode == 0 and len(r.stdout.splitlines()) <= 60, r.stdout
    at = [r.stdout.index(f"{o} " if o != "--shortlist" else o) for o in [*USER_OPTIONS, "--set", "--list-switches"]]
    assert at[:-2] and max(at[:-2]) < at[-2] < at[-1], at
    # no option of its own for a switch: each is --set NAME=on|off (shortlist, a user's choice, has both)
    flags = {w.strip("[],") for w in r.stdout.split() if w.startswith(("--", "[--"))}
    assert not {"--" + o.name.replace("_", "-") for o in OPTIMISATIONS if o.name != "shortlist"} & flags
    text = " ".join(r.stdout.split())
    assert "default (or auto): int8 on a CPU with an int8 kernel, else fp32; fp16 on CUDA" in text
    assert "--shortlist, --no-shortlist the model dir's lexical shortlist (default: " in text


class Made(Exception):
    """Raised by the recording Translator: the keywords the CLI handed the library are all the test needs."""


@pytest.fixture
def handed(monkeypatch):
    """What `main(argv)` hands decoder.Translator as keywords, without loading a model."""
    import decoder.__main__ as cli
    seen = {}

    def record(model_dir, **kw):
        seen.update(kw)
        raise Made

    monkeypatch.setattr(cli, "Translator", record)

    def run(*argv):
        seen.clear()
        with pytest.raises(Made):
            cli.main(["--model", "m", "-q", "-i", os.devnull, *argv])
        return dict(seen)
    return run


def test_set_turns_switches_on_and_off_and_leaves_the_others_to_the_library(handed):
    kw = handed("--set", "fused_norm=off", "--set", "kv_row_table=on", "--set", "shortlist=on", "--set", "chunk_lines=7")
    assert (kw["fused_norm"], kw["kv_row_table"], kw["shortlist"], kw["chunk_lines"]) == (False, True, True, 7)
    assert "sort" not in handed()  # not given: the library's default, whatever it is
    assert handed("--set", "fused_qkv=on", "--set", "fused_qkv=off")["fused_qkv"] is False  # the last one counts
    # --shortlist is the user's own option for the same switch; --chunk-lines the old name of the setting
    assert handed("--no-shortlist")["shortlist"] is False and "shortlist" not in handed()
    assert handed("--chunk-lines", "9")["chunk_lines"] == 9 == handed("--set", "chunk-lines=9")["chunk_lines"]


def test_every_switch_can_be_set_on_and_off():
    from decoder.__main__ import parse_args
    from decoder.optimisations import OPTIMISATIONS
    for o in OPTIMISATIONS:
        for word, value in (("on", True), ("OFF", False)):
            assert getattr(parse_args(["--model", "m", "--set", f"{o.name}={word}"]), o.name) is value, o.name


@pytest.mark.parametrize("setting,says", [
    ("fused_nrom=on", "unknown switch or setting 'fused_nrom'; did you mean fused_norm"),
    ("no_such_thing=on", "unknown switch or setting 'no_such_thing'; python -m decoder --list-switches lists them"),
    ("fused_norm=maybe", "fused_norm=maybe: expected on or off, got 'maybe'"),
    ("fused_norm", "expected NAME=on|off or NAME=VALUE, got 'fused_norm'"),
    ("chunk_lines=0", "chunk_lines=0: must be >= 1, got 0"),
    ("chunk_lines=on", "chunk_lines=on: expected an integer, got 'on'"),
])
def test_an_unknown_switch_or_value_is_one_error_line_exit_2(capsys, setting, says):
    from decoder.__main__ import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", "--set", setting])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"python -m decoder: error: argument --set: {says}"), err
    assert err.endswith(" (see python -m decoder --help)\n"), err


def test_list_switches_prints_each_switchs_name_default_label_and_worth(monkeypatch, capsys):
    import decoder.__main__ as cli
    measured = tuple(dataclasses.replace(o, worth=f"{i}.5x, test CPU, 2026-11-29")
                     for i, o in enumerate(cli.OPTIMISATIONS))
    monkeypatch.setattr(cli, "OPTIMISATIONS", measured)
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--list-switches"])  # without --model: it only lists
    out = capsys.readouterr().out.splitlines()
    assert e.value.code == 0
    for i, o in enumerate(measured):
        line = next(x for x in out if x.split()[0] == o.name)
        assert line.split()[1] == ("on" if o.default else "off") and o.label in line, line
        assert line.endswith(f"worth: {i}.5x, test CPU, 2026-11-29"), line
    settings = out[out.index("") + 1:]
    assert [x.split()[0] for x in settings[1:]] == list(cli.KNOBS) and "chunk_lines" in cli.KNOBS
    assert ["chunk_lines", str(cli.CHUNK_LINES)] in [x.split() for x in settings]


def test_set_switches_reach_the_decode(model_dir):
    """The whole command with switches and a setting: the library takes them and the lines come out."""
    lines = ["the dog", "", "the man sees a dog"]
    r = run_cli(model_dir, "\n".join(lines).encode() + b"\n", "--precision", "fp32", "--set", "fused_norm=off",
                "--set", "fused_qkv=off", "--set", "chunk_lines=2")
    assert r.returncode == 0, r.stderr.decode()
    from decoder import Translator
    want = Translator(model_dir, precision="fp32", fused_norm=False, fused_qkv=False, chunk_lines=2).translate(lines)
    assert r.stdout.decode().split("\n")[:-1] == want


def test_the_default_is_the_fast_path_and_the_settings_line_says_so(tmp_path):
    """No --precision, no --shortlist: int8 where this CPU has an int8 kernel (else fp32) and
    the model dir's shortlist when it has one, as the container runs; --precision fp32
    --no-shortlist still gives the model's own output."""
    import torch
    from decoder import modeldir, quant
    d = str(tmp_path / "model")
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model"), d)
    V = modeldir.read_config(d).arch.vocab_size
    modeldir.write_shortlist(d, torch.arange(V + 1) * 0, torch.zeros(0, dtype=torch.long), torch.arange(V))
    stdin = b"In the beginning God created the heavens and the earth.\nJesus wept.\n"
    fast = run_cli(d, stdin)
    assert fast.returncode == 0, fast.stderr
    line = fast.stderr.decode().strip().splitlines()[-1]
    int8 = quant.fbgemm_available() or quant.int_mm_vnni()
    assert line.startswith("decoder: precision " + ("int8" if int8 else "fp32") + " (the default")
    assert "the model dir's shortlist" in line
    plain = run_cli(d, stdin, "--precision", "fp32", "--no-shortlist")
    assert "precision fp32," in plain.stderr.decode() and "no shortlist" in plain.stderr.decode()
    assert len(fast.stdout.splitlines()) == len(plain.stdout.splitlines()) == 2
