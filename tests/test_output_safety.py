"""What the commands that train, export, convert and prepare never do: delete or overwrite
what they did not write, write through a link out of a model dir, let two runs write one
run dir, take a name for a path, read a device for a file, or leave a killed run's temp
files behind (docs/reliability.md "The training side")."""
from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from decoder import durable, modeldir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIBLE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny")
ARGS = dict(vocab_size=64, d_model=32, n_heads=4, ffn_dim=48, encoder_layers=1, decoder_layers=1, dropout=0.0)


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def checkpoint(path, spm_model) -> str:
    from student.model import ModelArgs, Transformer
    torch.manual_seed(0)
    m = Transformer(ModelArgs(**ARGS))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": m.state_dict(), "model_args": dataclasses.asdict(m.args), "step": 1,
                "meta": {"spm_model": str(spm_model), "src_lang": "en", "tgt_lang": "es"}}, path)
    return str(path)


def files(d) -> dict:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -- never delete or overwrite what the command did not write ----------------------------------

def test_export_into_its_own_run_dir_is_refused_and_keeps_every_checkpoint(tmp_path, tiny_spm, capsys):
    from student.export import main
    run = tmp_path / "run"
    for name in ("best.pt", "last.pt", "ckpt-0000002.pt"):
        checkpoint(run / name, tiny_spm)
    (run / "metrics.json").write_text("{}")
    before = files(run)
    for force in ([], ["--force"]):  # the checkpoint inside OUT_DIR: even --force does not delete it
        assert main([str(run / "best.pt"), str(run), *force]) == 2
        assert "holds the checkpoint" in one_error(capsys)
        assert files(run) == before


def test_export_over_a_dir_with_other_files_needs_force_and_over_its_own_model_dir_does_not(tmp_path, tiny_spm,
                                                                                                 capsys):
    from student.export import main
    ckpt = checkpoint(tmp_path / "run" / "best.pt", tiny_spm)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main([ckpt, str(out)]) == 2
    assert "'notes.txt'" in one_error(capsys) and (out / "notes.txt").read_text() == "mine"
    model = tmp_path / "model"
    assert main([ckpt, str(model)]) == 0 and main([ckpt, str(model)]) == 0  # a model dir of ours: replaced
    assert sorted(os.listdir(model)) == ["config.json", "model.safetensors", "spm.model"]
    assert main([ckpt, str(out), "--force"]) == 0 and not (out / "notes.txt").exists()
    (tmp_path / "file").write_text("x")
    assert main([ckpt, str(tmp_path / "file")]) == 2
    assert "not a directory" in one_error(capsys) and (tmp_path / "file").read_text() == "x"


def test_convert_never_replaces_a_dir_holding_its_input_even_with_force(tmp_path, capsys):
    from tools.convert.__main__ import main
    shutil.copytree(os.path.join(BIBLE, "model"), tmp_path / "run" / "model")
    assert main(["--to", "ct2", str(tmp_path / "run" / "model"), str(tmp_path / "run"), "--force"]) == 2
    assert "would replace the input" in one_error(capsys)
    assert sorted(os.listdir(tmp_path / "run" / "model")) == ["config.json", "model.safetensors", "spm.model"]


def test_distill_refuses_a_run_dir_that_is_not_one_of_its_runs_unless_forced(tmp_path, capsys):
    from student.distill.__main__ import options
    (tmp_path / "runs" / "docs").mkdir(parents=True)
    (tmp_path / "runs" / "docs" / "thesis.tex").write_text("mine")
    argv = ["--runs-dir", str(tmp_path / "runs"), "--name", "docs", "--teacher-cmd", "cat"]
    with pytest.raises(SystemExit):
        options(argv)
    assert "not a student.distill run" in one_error(capsys)
    assert options(argv + ["--force"]).name == "docs"


def test_a_model_dir_writer_replaces_a_link_in_the_dir_and_never_follows_it_out(tmp_path, capsys):
    from student.shortlist.__main__ import main
    model = tmp_path / "model"
    shutil.copytree(os.path.join(BIBLE, "model"), model)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the kit's")
    (model / "shortlist.safetensors").symlink_to(outside)
    assert main(["--model", str(model), "--src", os.path.join(BIBLE, "test.en"), "--tgt",
                 os.path.join(BIBLE, "test.es"), "--k", "5", "--frequent", "5"]) == 0
    assert outside.read_bytes() == b"not the kit's"
    assert not os.path.islink(model / "shortlist.safetensors")
    modeldir.read_shortlist(str(model), modeldir.read_config(str(model)))


# -- one writer per run dir ----------------------------------------------------------------------

def hold(path):
    """A process holding the run dir's lock, as a run writing it does."""
    code = ("import sys, time\nfrom decoder import durable\nwith durable.locked(sys.argv[1]):\n"
            "    print('held', flush=True)\n    time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_on_a_run_dir_being_written_is_one_line_naming_the_holder(tmp_path, toy_files, capsys):
    from student.distill.__main__ import main as distill
    from student.train.__main__ import main as train
    run = tmp_path / "run"
    holder = hold(run)
    try:
        assert train(["--out", str(run), "--src", str(toy_files / "train.en"), "--tgt", str(toy_files / "train.es"),
                      "--max-steps", "1"]) == 2
        assert f"in use by another run (process {holder.pid})" in one_error(capsys)
        assert os.listdir(run) == [durable.LOCK]  # nothing of the second run written
        assert distill(["--runs-dir", str(tmp_path), "--name", "run", "--teacher-cmd", "cat", "--force",
                        "--src", str(toy_files / "train.en"), "--tgt", str(toy_files / "train.es")]) == 2
        assert f"(process {holder.pid})" in one_error(capsys)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with durable.locked(str(run)):  # the kernel dropped the killed holder's lock
        with pytest.raises(durable.Busy):
            with durable.locked(str(run)):
                pass
    assert os.listdir(run) == []  # the lock file goes with the lock


# -- names that become paths, files read by name -------------------------------------------------

@pytest.mark.parametrize("flag,code", [("--src-lang", "e/n"), ("--tgt-lang", "/../../../outside/x"),
                                       ("--src-lang", "x" * 36), ("--tgt-lang", ".."), ("--src-lang", "")])
def test_a_language_code_that_would_be_a_path_is_refused(tmp_path, toy_files, capsys, flag, code):
    from student.data.__main__ import main
    argv = ["prepare", "toy", "--src", str(toy_files / "train.en"), "--tgt", str(toy_files / "train.es"),
            "--data-dir", str(tmp_path / "data"), flag, code]
    assert main(argv) == 2
    assert flag in one_error(capsys)
    assert not (tmp_path / "data" / "prepared").exists()


def test_a_config_language_that_is_not_a_code_is_refused():
    d = modeldir.read_json(os.path.join(BIBLE, "model", "config.json"))
    d["languages"]["tgt"] = "../es"
    with pytest.raises(modeldir.ModelDirError, match="languages.tgt"):
        modeldir.check_config(d)


@pytest.mark.parametrize("name", ["../up", "a/b", ".hidden", "x" * 101])
def test_a_corpus_name_that_is_a_path_is_refused(tmp_path, toy_files, capsys, name):
    from student.data.__main__ import main
    assert main(["prepare", name, "--src", str(toy_files / "train.en"), "--tgt", str(toy_files / "train.es"),
                 "--data-dir", str(tmp_path / "data")]) == 2
    assert "corpus name" in one_error(capsys)


@pytest.mark.parametrize("what", ["/dev/zero", "fifo", "huge"])
def test_a_checkpoint_naming_a_device_or_a_huge_file_as_its_spm_model_is_refused(tmp_path, capsys, what):
    from student.export import main
    spm = {"/dev/zero": "/dev/zero", "fifo": str(tmp_path / "fifo"), "huge": str(tmp_path / "huge.model")}[what]
    if what == "fifo":
        os.mkfifo(spm)
    if what == "huge":
        with open(spm, "wb") as fh:
            fh.truncate(modeldir.MAX_SPM_BYTES + 1)  # sparse: no disk used
    ckpt = checkpoint(tmp_path / "run" / "best.pt", spm)
    assert main([ckpt, str(tmp_path / "model")]) == 2
    assert spm in one_error(capsys)
    assert not (tmp_path / "model").exists() and not [n for n in os.listdir(tmp_path) if ".tmp." in n]


# -- one line for every file-system failure --------------------------------------------------------

@pytest.mark.parametrize("e,line", [
    (OSError(errno.ENOSPC, "No space left on device", "/o/model.safetensors.tmp.123"),
     "/o/model.safetensors: no space left on the device (the disk is full)"),
    (OSError(errno.EROFS, "Read-only file system", "/o/.model.tmp.123.ab12cd34/spm.model"),
     "/o/model/spm.model: read-only file system"),
    (PermissionError(errno.EACCES, "Permission denied", "/o/a", None, "/o/b"), "/o/a -> /o/b: permission denied"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/o/f/x"), "/o/f/x: not a directory"),
    (pickle.UnpicklingError("Weights only load failed"), "refused: not a weights-only torch checkpoint"),
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
     "no space left on the device"),
])
def test_file_system_failures_and_refused_files_have_one_shared_line(e, line, capsys):
    from decoder import fileerrors

    @fileerrors.one_line
    def main():
        raise e
    assert main() in (1, 2)
    assert one_error(capsys).startswith(f"error: {line}")


def test_anything_else_is_left_to_raise():
    from decoder import fileerrors

    @fileerrors.one_line
    def main():
        raise KeyError("a bug")
    with pytest.raises(KeyError):
        main()


# -- leftovers of killed runs ----------------------------------------------------------------------

def test_a_killed_prepares_temp_dirs_are_removed_at_the_next_start(tmp_path, toy_files):
    from student.data import prepare
    prepared = tmp_path / "data" / "prepared"
    dead, live = prepared / f".toy-en-es-0123.tmp.{dead_pid()}.deadbeef", prepared / ".toy-en-es-0123.tmp.1.cafe0123"
    for d in (dead, live):
        (d / "train.en").parent.mkdir(parents=True)
        (d / "train.en").write_text("half")
    prepare("toy", src=str(toy_files / "train.en"), tgt=str(toy_files / "train.es"), vocab_size=300,
            data_dir=str(tmp_path / "data"), verbose=False)
    assert not dead.exists() and live.exists()  # pid 1 is alive: not ours to remove


def test_a_killed_decoders_temp_output_is_removed_at_the_next_start(tmp_path):
    from decoder.__main__ import main
    (tmp_path / "in.txt").write_text("in the beginning\n")
    dead, live = tmp_path / f"out.txt.tmp.{dead_pid()}", tmp_path / "out.txt.tmp.1"
    for f in (dead, live):
        f.write_text("half")
    assert main(["--model", os.path.join(BIBLE, "model"), "-i", str(tmp_path / "in.txt"), "-o",
                 str(tmp_path / "out.txt"), "--threads", "1", "--quiet"]) == 0
    assert not dead.exists() and live.exists() and (tmp_path / "out.txt").read_text().count("\n") == 1


def test_a_killed_export_or_shortlist_leaves_nothing_at_the_next_start(tmp_path, tiny_spm):
    from student.export import export_checkpoint
    pid = dead_pid()
    ckpt = checkpoint(tmp_path / "run" / "best.pt", tiny_spm)
    stale = [tmp_path / f".model.tmp.{pid}.0badf00d", tmp_path / f"model.old.tmp.{pid}"]
    for d in stale:
        d.mkdir()
    export_checkpoint(ckpt, str(tmp_path / "model"))
    assert sorted(os.listdir(tmp_path)) == ["model", "run"]
    from student.shortlist import add_to_model_dir
    stale = [tmp_path / f".model-shortlist.tmp.{pid}.k2j4_x9q", tmp_path / "model" / f"shortlist.safetensors.tmp.{pid}"]
    stale[0].mkdir()
    stale[1].write_bytes(b"half")
    (tmp_path / "en").write_text("the man\n")
    (tmp_path / "es").write_text("el hombre\n")
    add_to_model_dir(str(tmp_path / "model"), str(tmp_path / "en"), str(tmp_path / "es"), k=2, n_frequent=2)
    assert not any(f.exists() for f in stale)
    assert sorted(os.listdir(tmp_path / "model")) == ["config.json", "model.safetensors", "shortlist.safetensors",
                                                      "spm.model"]


def test_a_killed_distillations_temp_files_are_removed_when_the_next_run_takes_the_dir(tmp_path):
    from student.distill.__main__ import _locked_and_clean
    pid = dead_pid()
    run = tmp_path / "up"
    (run / "corpus-0123456789ab").mkdir(parents=True)
    stale = [run / f"manifest.json.tmp.{pid}", run / "corpus-0123456789ab" / f"train.src.tmp.{pid}"]
    for f in stale + [run / "manifest.json"]:
        f.write_text("x")
    with _locked_and_clean(str(run)):
        assert not any(f.exists() for f in stale) and (run / "manifest.json").exists()
