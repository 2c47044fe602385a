"""Checkpoints meet the model dir's schema, resume starts from the newest checkpoint that loads,
and a refused or unreadable file is one error line: a checkpoint's model_args with an unknown key
(before: a TypeError traceback in student.export) or a vocabulary of 2**40 (before: an allocation
of petabytes), a truncated last.pt (before: a PytorchStreamReader traceback, no fallback to the
step checkpoints), a planted pickle in last.pt or in an HF dir's pytorch_model.bin (before: a
traceback advising weights_only=False), random bytes for a model dir's spm.model in
student.shortlist (before: a RuntimeError traceback)."""
import dataclasses
import os
import pickle
import shutil

import pytest
import torch

from conftest import ROOT

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")
TINY = ["--preset", "student-tiny", "--set", "d_model=32", "--set", "n_heads=2", "--set", "ffn_dim=64",
        "--set", "encoder_layers=1", "--set", "dropout=0.1", "--vocab-size", "320", "--amp", "off",
        "--max-tokens", "300", "--eval-every", "0", "--save-every", "5", "--no-test"]


class Planted:
    """A pickle that runs a command when loaded without weights_only."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "weights_only=False" not in err, err
    return [x for x in err.splitlines() if x.startswith("error:")]


def tiny_checkpoint(path, spm_model: str, **args):
    from student.model import ModelArgs, Transformer
    a = ModelArgs(vocab_size=64, d_model=8, n_heads=2, ffn_dim=16, encoder_layers=1, decoder_layers=1)
    model = Transformer(a)
    torch.save({"model_args": {**dataclasses.asdict(a), **args}, "model": model.state_dict(),
                "meta": {"spm_model": spm_model}, "step": 1}, path)


@pytest.mark.parametrize("args, says", [
    ({"n_layers": 3}, "model_args n_layers: not a model field"),
    ({"vocab_size": 2**40}, "model_args: architecture.vocab_size must be in [1, 1,048,576], got 1099511627776"),
    ({"d_model": "wide"}, "model_args: architecture.d_model must be an integer"),
    ({"dropout": torch.zeros(2)}, "model_args dropout: must be a number, a string or true/false"),
])
def test_export_of_a_checkpoint_whose_model_args_leave_the_schema_is_one_line_before_any_allocation(
        tmp_path, capsys, monkeypatch, tiny_spm, args, says):
    from student.export import main
    from student.model import Transformer
    ck = tmp_path / "x.pt"
    tiny_checkpoint(ck, tiny_spm, **args)

    def allocate(*a, **k):
        raise AssertionError("a model was built from unchecked model_args")
    monkeypatch.setattr(Transformer, "__init__", allocate)
    assert main([str(ck), str(tmp_path / "model")]) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {ck}: ") and says in err[0], err
    assert not (tmp_path / "model").exists()


def test_export_of_a_checkpoint_whose_weights_do_not_fit_its_model_args_is_one_line(tmp_path, capsys, tiny_spm):
    from student.export import main
    ck = tmp_path / "x.pt"
    tiny_checkpoint(ck, tiny_spm, ffn_dim=32)  # the weights are those of ffn_dim 16
    assert main([str(ck), str(tmp_path / "model")]) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {ck}: its weights do not fit its model_args"), err


def fake_run(d, steps: dict):
    """A run dir of checkpoints, {file name: step}; a step of None is a file cut short."""
    d.mkdir()
    for name, step in steps.items():
        if step is None:
            (d / name).write_bytes(b"PK\x03\x04 cut short")
            continue
        torch.save({"model_args": {}, "model": {}, "meta": {}, "step": step}, d / name)


def test_resume_picks_the_newest_checkpoint_that_loads_and_says_what_it_skipped(tmp_path):
    from student.checkpoint import newest_checkpoint
    ok = lambda ck, path: None  # noqa: E731
    fake_run(tmp_path / "a", {"last.pt": 10, "ckpt-0000005.pt": 5, "ckpt-0000010.pt": 10, "ckpt-0000015.pt": 15})
    path, ck, skipped = newest_checkpoint(str(tmp_path / "a"), ok)
    assert os.path.basename(path) == "ckpt-0000015.pt" and ck["step"] == 15 and skipped == []
    fake_run(tmp_path / "b", {"last.pt": None, "ckpt-0000005.pt": 5, "ckpt-0000010.pt": None})
    path, ck, skipped = newest_checkpoint(str(tmp_path / "b"), ok)
    assert os.path.basename(path) == "ckpt-0000005.pt" and ck["step"] == 5
    assert [s.split(":")[0] for s in skipped] == [str(tmp_path / "b" / n) for n in ("last.pt", "ckpt-0000010.pt")]
    assert all("not a torch checkpoint" in s for s in skipped)
    fake_run(tmp_path / "c", {"last.pt": 10, "ckpt-0000005.pt": 5})
    path, ck, skipped = newest_checkpoint(str(tmp_path / "c"), ok)
    assert os.path.basename(path) == "last.pt" and skipped == []
    fake_run(tmp_path / "d", {"last.pt": None})
    assert newest_checkpoint(str(tmp_path / "d"), ok)[:2] == (None, None)
    assert newest_checkpoint(str(tmp_path / "e"), ok) == (None, None, [])


@pytest.fixture(scope="module")
def trained(toy_files, tmp_path_factory):
    """A 10-step run dir: last.pt at step 10, ckpt-0000005.pt and ckpt-0000010.pt; its data cache."""
    from student.train.__main__ import main
    d = tmp_path_factory.mktemp("trained")
    mp = pytest.MonkeyPatch()
    mp.setenv("KIT_DATA_DIR", str(d / "data"))
    try:
        assert train_main(main, toy_files, d / "run", "--max-steps", "10") == 0
    finally:
        mp.undo()
    return d


def train_main(main, toy_files, out, *extra) -> int:
    return main(["--src", str(toy_files / "train.en"), "--tgt", str(toy_files / "train.es"), "--src-lang", "en",
                 "--tgt-lang", "es", "--out", str(out), *TINY, *extra])


def resume(trained, toy_files, tmp_path, monkeypatch, spoil) -> tuple[int, str]:
    from student.train.__main__ import main
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    spoil(run)
    monkeypatch.setenv("KIT_DATA_DIR", str(trained / "data"))
    return train_main(main, toy_files, run, "--max-steps", "15"), run


def test_resume_from_a_truncated_last_pt_says_so_and_resumes_from_the_newest_step_checkpoint(
        trained, toy_files, tmp_path, monkeypatch, capsys):
    def cut(run):
        last = run / "last.pt"
        last.write_bytes(last.read_bytes()[:1000])
    rc, run = resume(trained, toy_files, tmp_path, monkeypatch, cut)
    out = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out.err, out.err[-3000:]
    said = [x for x in out.err.splitlines() if x.startswith("warning: not resuming from")]
    assert len(said) == 1 and said[0].startswith(f"warning: not resuming from {run / 'last.pt'}: not a torch "
                                                 f"checkpoint ("), said
    assert f"resuming from {run / 'ckpt-0000010.pt'} at step 10" in out.out
    assert torch.load(run / "last.pt", weights_only=True)["step"] == 15


def test_resume_with_no_checkpoint_that_loads_is_one_error_line_and_keeps_the_files(
        trained, toy_files, tmp_path, monkeypatch, capsys):
    def cut_all(run):
        for f in ("last.pt", "ckpt-0000005.pt", "ckpt-0000010.pt"):
            (run / f).write_bytes((run / f).read_bytes()[:500])
    rc, run = resume(trained, toy_files, tmp_path, monkeypatch, cut_all)
    err = errors(capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {run}: no checkpoint to resume from loads (3 tried"), err
    assert all((run / f).stat().st_size == 500 for f in ("last.pt", "ckpt-0000005.pt", "ckpt-0000010.pt"))


def test_resume_refuses_a_planted_pickle_in_last_pt_in_one_line_and_never_runs_it(
        trained, toy_files, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "ran"

    def plant(run):
        for f in ("ckpt-0000005.pt", "ckpt-0000010.pt"):
            os.remove(run / f)
        torch.save(Planted(marker), run / "last.pt")
    rc, run = resume(trained, toy_files, tmp_path, monkeypatch, plant)
    out = capsys.readouterr()
    assert "weights_only=False" not in out.out + out.err and "Traceback" not in out.err
    said = [x for x in out.err.splitlines() if x.startswith("warning:")]
    assert said == [f"warning: not resuming from {run / 'last.pt'}: refused: not a weights-only torch checkpoint "
                    f"(arbitrary pickles are never loaded)"], said
    err = [x for x in out.err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(err) == 1 and "no checkpoint to resume from loads" in err[0], err
    assert not marker.exists()


def test_resume_from_a_checkpoint_of_another_model_is_refused_naming_the_difference(
        trained, toy_files, tmp_path, monkeypatch, capsys):
    from student.train.__main__ import main
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    monkeypatch.setenv("KIT_DATA_DIR", str(trained / "data"))
    assert train_main(main, toy_files, run, "--max-steps", "15", "--set", "ffn_dim=128") == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "a checkpoint of another model (ffn_dim 64, not 128)" in out.err


def test_convert_from_hf_of_a_planted_pickle_is_one_line_saying_it_was_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tools.convert.__main__ import main
    hf = tmp_path / "hf"
    assert main(["--to", "hf", FIXTURE, str(hf)]) == 0
    os.remove(hf / "model.safetensors")
    marker = tmp_path / "ran"
    with open(hf / "pytorch_model.bin", "wb") as fh:
        pickle.dump(Planted(marker), fh)
    capsys.readouterr()
    assert main(["--from-hf", str(hf), str(tmp_path / "back")]) == 2
    err = errors(capsys)
    assert err == [f"error: {hf / 'pytorch_model.bin'}: refused: not a weights-only torch checkpoint "
                   f"(arbitrary pickles are never loaded)"], err
    assert not marker.exists() and not (tmp_path / "back").exists()


def test_shortlist_of_a_model_dir_whose_spm_model_is_random_bytes_is_one_error_line(tmp_path, capsys):
    from student.shortlist.__main__ import main
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    (d / "spm.model").write_bytes(os.urandom(5000))
    src = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "test.en")
    assert main(["--model", str(d), "--src", src, "--tgt", src.replace(".en", ".es")]) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {d / 'spm.model'}: unreadable SentencePiece model"), err
    assert not (d / "shortlist.safetensors").exists()
