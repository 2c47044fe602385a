"""Outputs survive a crash whole or not at all, and a completion marker is
written only once what it vouches for is on the disk.

A kill lands inside a write only by luck, so these tests inject the failure:
a write torn half way, an fsync or a rename that raises. A plain write onto
the target (torch.save onto last.pt, open() of the shard) fails them, and so
does a missing fsync of the file before the rename or of the dir after it."""
import contextlib
import io
import os

import pytest
import torch

from decoder import durable


class Recorder:
    """Every fsync (by the path of its fd) and rename, in order."""

    def __init__(self, monkeypatch):
        self.events = []
        fsync, replace, rename = os.fsync, os.replace, os.rename

        def rec_fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return fsync(fd)

        def rec_rename(real):
            def f(src, dst, *a, **kw):
                self.events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))
                return real(src, dst, *a, **kw)
            return f
        monkeypatch.setattr(os, "fsync", rec_fsync)
        monkeypatch.setattr(os, "replace", rec_rename(replace))
        monkeypatch.setattr(os, "rename", rec_rename(rename))

    def index(self, *event) -> int:
        return self.events.index(tuple(str(x) for x in event))

    def rename_to(self, dst) -> int:
        return next(i for i, e in enumerate(self.events) if e[0] == "rename" and e[2] == str(dst))


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_dir_after(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    target = tmp_path / "out.txt"
    durable.write_lines(str(target), ["a", "b"])
    tmp = durable.tmp_name(str(target))
    assert rec.events == [("fsync", tmp), ("rename", tmp, str(target)), ("fsync", str(tmp_path))]
    assert target.read_text() == "a\nb\n"


def test_published_dir_has_every_file_on_disk_before_the_rename(tmp_path, monkeypatch):
    src = tmp_path / ".tmp-model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"x")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "old.txt").write_text("old")
    rec = Recorder(monkeypatch)
    durable.publish_dir(str(src), str(tmp_path / "model"))
    swap = rec.rename_to(tmp_path / "model")
    for p in (src / "config.json", src / "sub" / "w.bin", src / "sub", src):
        assert rec.index("fsync", p) < swap
    assert rec.index("fsync", tmp_path) > swap
    assert sorted(os.listdir(tmp_path)) == ["model"] and sorted(os.listdir(tmp_path / "model")) == ["config.json",
                                                                                                      "sub"]


def _torn(path):
    with open(path, "wb") as fh:
        fh.write(b"half of it")
    raise OSError(28, "injected: no space left on device")


def _fail_fsync(fd):
    raise OSError(5, "injected: I/O error")


@pytest.mark.parametrize("where", ["torn write", "fsync", "rename"])
def test_failed_write_keeps_the_previous_file_and_no_temp(tmp_path, monkeypatch, where):
    target = tmp_path / "last.pt"
    durable.write_text(str(target), "previous")
    write = lambda tmp: open(tmp, "w").write("new")  # noqa: E731
    if where == "torn write":
        write = _torn
    elif where == "fsync":
        monkeypatch.setattr(os, "fsync", _fail_fsync)
    else:
        monkeypatch.setattr(os, "replace", lambda *a: _fail_fsync(0))
    with pytest.raises(OSError, match="injected"):
        durable.atomic_write(str(target), write)
    assert target.read_text() == "previous"
    assert os.listdir(tmp_path) == ["last.pt"]


def test_stage_done_json_follows_its_outputs_onto_the_disk(tmp_path, monkeypatch):
    from student.distill.stages import Run

    def work(d):  # a stage output written without any care, as a teacher or tool might
        os.makedirs(f"{d}/shards")
        with open(f"{d}/shards/shard-00000.txt", "w") as fh:
            fh.write("hola\n")

    def finish(d):
        durable.write_lines(f"{d}/distilled.txt", ["hola"])
        return {"sentences": 1}

    run = Run(str(tmp_path / "run"), {}, log=lambda *a: None)
    rec = Recorder(monkeypatch)
    _, d, result = run.stage("distill", {"x": 1}, [], work, finish)
    assert result == {"sentences": 1}
    done = rec.rename_to(os.path.join(d, "done.json"))
    for p in ("shards/shard-00000.txt", "shards", "distilled.txt", ""):
        assert rec.index("fsync", os.path.join(d, p).rstrip("/")) < done, p
    assert rec.index("fsync", durable.tmp_name(os.path.join(d, "done.json"))) < done
    assert ("fsync", d) in rec.events[done + 1:]


class Teacher:
    def __init__(self, fail_on=None):
        self.calls, self.fail_on = [], fail_on
        self.monkeypatch = None

    def translate(self, lines, where=""):
        self.calls.append(lines[0])
        if self.fail_on is not None and lines[0] == self.fail_on:
            self.monkeypatch.setattr(os, "fsync", _fail_fsync)  # the disk fails while this shard is saved
        return [s.upper() for s in lines]


def test_failed_shard_write_leaves_no_partial_shard(tmp_path, monkeypatch):
    from student.distill.shards import assemble, shard_path, translate_shards
    src = [f"line {i}" for i in range(10)]
    t = Teacher(fail_on="line 3")
    t.monkeypatch = monkeypatch
    with pytest.raises(OSError, match="injected"):
        translate_shards(t, src, str(tmp_path), 3, verbose=False)
    monkeypatch.undo()
    assert os.path.exists(shard_path(str(tmp_path), 0))
    assert sorted(os.listdir(tmp_path)) == ["shard-00000.txt"]  # not shard 1, whole or partial
    again = Teacher()
    translate_shards(again, src, str(tmp_path), 3, verbose=False)
    assert again.calls == ["line 3", "line 6", "line 9"]
    assert assemble(str(tmp_path), len(src), 3) == [s.upper() for s in src]


def test_failed_checkpoint_save_keeps_the_previous_last_pt(toy_files, tmp_path, monkeypatch):
    """Through the trainer's own save path: torch.save dies half way through
    last.pt of step 10; the step-5 last.pt stays loadable and a rerun resumes from it."""
    from student.train.trainer import TrainConfig, train
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))
    torch.set_num_threads(1)
    cfg = dict(out_dir=str(tmp_path / "run"), preset="student-tiny", src=str(toy_files / "train.en"),
               tgt=str(toy_files / "train.es"), src_lang="en", tgt_lang="es", vocab_size=320, amp="off",
               model_overrides=dict(d_model=32, n_heads=2, ffn_dim=64, encoder_layers=1),
               max_tokens=300, save_every=5, eval_every=0, test_at_end=False)
    train(TrainConfig(max_steps=5, **cfg))
    last = tmp_path / "run" / "last.pt"
    assert torch.load(last, weights_only=True)["step"] == 5

    save = torch.save

    def torn_save(obj, f, *a, **kw):  # f: a name or an open file (the trainer's)
        if not os.path.basename(getattr(f, "name", str(f))).startswith("last.pt"):
            return save(obj, f, *a, **kw)
        buf = io.BytesIO()
        save(obj, buf, *a, **kw)
        with contextlib.nullcontext(f) if hasattr(f, "write") else open(f, "wb") as fh:
            fh.write(buf.getvalue()[:len(buf.getvalue()) // 2])
        raise OSError(28, "injected: no space left on device")
    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="injected"):
        train(TrainConfig(max_steps=10, **cfg))
    monkeypatch.setattr(torch, "save", save)
    assert torch.load(last, weights_only=True)["step"] == 5
    assert not [f for f in os.listdir(last.parent) if ".tmp" in f]
    assert train(TrainConfig(max_steps=10, **cfg))["step"] == 10


def test_stray_files_in_the_shard_dir_are_left_alone_and_a_killed_writers_temp_removed(tmp_path):
    from student.distill.shards import assemble, translate_shards
    (tmp_path / "notes.tmp.txt").write_text("mine")       # not a shard temp: no crash, kept
    (tmp_path / "shard-00001.txt.tmp.999").write_text("LINE 3\n")  # a killed writer's half shard
    src = [f"line {i}" for i in range(6)]
    translate_shards(Teacher(), src, str(tmp_path), 3, verbose=False)
    assert sorted(os.listdir(tmp_path)) == ["notes.tmp.txt", "shard-00000.txt", "shard-00001.txt"]
    assert assemble(str(tmp_path), len(src), 3) == [s.upper() for s in src]


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _modes(root) -> dict:
    out = {".": os.stat(root).st_mode & 0o7777}
    for base, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(base, n)
            out[os.path.relpath(p, root)] = os.stat(p).st_mode & 0o7777
    return out


def test_published_files_and_dirs_get_the_modes_of_the_users_umask(tmp_path, umask):
    import tempfile

    from safetensors.torch import save_file
    f, d = 0o666 & ~umask, 0o777 & ~umask
    # safetensors writes 0600, mkstemp 0600, mkdtemp 0700: published, they follow the umask
    durable.atomic_write(str(tmp_path / "w.safetensors"), lambda tmp: save_file({"w": torch.zeros(2)}, tmp))
    assert os.stat(tmp_path / "w.safetensors").st_mode & 0o7777 == f

    def write(tmp):
        save_file({"w": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))
        fd, _ = tempfile.mkstemp(dir=tmp)
        os.close(fd)
        tempfile.mkdtemp(dir=tmp)
        with open(os.path.join(tmp, "run.sh"), "w") as fh:
            fh.write("#!/bin/sh\n")
        os.chmod(os.path.join(tmp, "run.sh"), 0o700)
    out = durable.write_dir(str(tmp_path / "out"), write)
    modes = _modes(out)
    assert modes.pop("run.sh") == d  # executable stays executable
    assert sorted(set(modes.values())) == sorted({f, d}) and modes["."] == d and modes["model.safetensors"] == f
    assert sorted(os.listdir(tmp_path)) == ["out", "w.safetensors"]  # no temp dir left


def test_write_dir_failure_leaves_the_previous_dir_and_no_temp(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")

    def write(tmp):
        open(os.path.join(tmp, "half"), "w").close()
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        durable.write_dir(str(tmp_path / "out"), write)
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(tmp_path / "out") == ["old.txt"]
