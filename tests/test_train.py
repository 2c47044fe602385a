"""The trainer end to end on a toy corpus: learning, exact resume after kill -9, DDP."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT

TINY = ["--preset", "student-tiny", "--set", "d_model=32", "--set", "n_heads=2", "--set", "ffn_dim=64",
        "--set", "encoder_layers=1", "--set", "dropout=0.1", "--vocab-size", "320", "--amp", "off"]


def run_train(toy_files, data_dir, out, *extra, env_extra=None, launcher=None, wait=True):
    env = {**os.environ, "KIT_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = (launcher or [sys.executable, "-m", "student.train"]) + [
        "--src", str(toy_files / "train.en"), "--tgt", str(toy_files / "train.es"),
        "--src-lang", "en", "--tgt-lang", "es", "--out", str(out), *TINY, *extra]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def metrics(out):
    return json.load(open(os.path.join(out, "metrics.json")))


def test_loss_falls_over_fifty_steps(toy_files, tmp_path):
    run_train(toy_files, tmp_path / "data", tmp_path / "run", "--max-steps", "50", "--max-tokens", "400",
              "--lr", "3e-3", "--warmup", "10", "--eval-every", "25")
    m = metrics(tmp_path / "run")
    losses = m["train_loss"]
    assert len(losses) == 50 and m["step"] == 50
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert [h["step"] for h in m["history"]] == [25, 50]
    assert "test_bleu" in m and "nrefs:1|" in m["test_bleu_signature"]
    # the dev-BLEU curve, drawn from the same history, beside metrics.json
    assert (tmp_path / "run" / "dev-bleu.png").read_bytes().startswith(b"\x89PNG")


def test_kill_during_training_then_resume_matches_uninterrupted_run(toy_files, tmp_path):
    common = ["--max-steps", "120", "--max-tokens", "300", "--save-every", "5", "--eval-every", "0",
              "--no-test"]
    run_train(toy_files, tmp_path / "data", tmp_path / "ref", *common)
    p = run_train(toy_files, tmp_path / "data", tmp_path / "killed", *common, wait=False)
    last = tmp_path / "killed" / "last.pt"
    deadline = time.time() + 300
    while not last.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # land somewhere after the first checkpoint, maybe inside a later save
    assert p.poll() is None, "training finished before it could be killed"
    p.kill()
    p.wait()
    assert torch.load(last, weights_only=True)["step"] < 120
    r = run_train(toy_files, tmp_path / "data", tmp_path / "killed", *common)
    assert "resuming from" in r.stdout + r.stderr
    assert metrics(tmp_path / "killed")["step"] == 120
    a = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "killed" / "last.pt", weights_only=True)["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not [f for f in os.listdir(tmp_path / "killed") if ".tmp" in f]


def test_start_removes_saves_cut_short_by_dead_processes_only(tmp_path):
    from student.train.trainer import remove_stale_tmp
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f"last.pt.tmp.{dead.pid}", f"last.pt.tmp.{os.getppid()}", f"best.pt.tmp.{os.getpid()}", "last.pt"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert remove_stale_tmp(str(tmp_path)) == [names[0]]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


def test_torchrun_two_processes_keep_replicas_identical(toy_files, tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                "-m", "student.train"]
    # prepare once outside, so the two ranks only read the cache
    dump = tmp_path / "params"
    run_train(toy_files, tmp_path / "data", tmp_path / "ddp", "--max-steps", "15", "--max-tokens", "300",
              "--eval-every", "0", "--no-test", launcher=launcher, env_extra={"KIT_DUMP_PARAMS_DIR": str(dump)})
    r0 = torch.load(dump / "rank0.pt", weights_only=True)
    r1 = torch.load(dump / "rank1.pt", weights_only=True)
    saved = torch.load(tmp_path / "ddp" / "last.pt", weights_only=True)["model"]
    assert metrics(tmp_path / "ddp")["step"] == 15
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
        assert torch.equal(r0[k], saved[k]), k


def test_bf16_autocast_trains_to_the_fp32_loss_curve_within_tolerance(toy_files, tmp_path):
    """`--amp bf16` is a speed switch (student/train/speed.py): it must learn as fp32 does."""
    common = ["--max-steps", "40", "--max-tokens", "400", "--lr", "3e-3", "--warmup", "10", "--eval-every", "0",
              "--no-test"]
    curves = {}
    for amp in ("off", "bf16"):
        run_train(toy_files, tmp_path / "data", tmp_path / amp, *common, "--amp", amp)
        curves[amp] = metrics(tmp_path / amp)["train_loss"]
    fp32, bf16 = curves["off"], curves["bf16"]
    assert len(fp32) == len(bf16) == 40
    assert fp32 != bf16  # autocast ran: bf16 products round differently
    for a, b in zip(fp32, bf16):  # same batches, same seed: step by step within 5%
        assert abs(a - b) <= 0.05 * a, (fp32, bf16)
    assert sum(bf16[-5:]) < 0.8 * sum(bf16[:5])


def test_amp_auto_is_bf16_only_on_cpus_with_native_bf16(monkeypatch):
    from student.train import trainer
    cpu = torch.device("cpu")
    monkeypatch.setattr(trainer, "cpu_has_bf16", lambda: True)
    assert trainer.autocast_setup("auto", cpu) == (torch.bfloat16, None)
    monkeypatch.setattr(trainer, "cpu_has_bf16", lambda: False)
    assert trainer.autocast_setup("auto", cpu) == (None, None)  # emulated bf16 was 20x slower
    assert trainer.autocast_setup("bf16", cpu) == (torch.bfloat16, None)
    assert trainer.autocast_setup("off", cpu) == (None, None)
    # CUDA: tests/test_train_sizing.py (sizing.amp_dtype_for, per GPU kind)


def test_trainer_speed_tool_lists_its_configurations_and_refuses_an_unknown_one():
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "student.train.speed", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "bf16+compile" in r.stdout and "(default: teacher-tiny)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "student.train.speed", "--configs", "fp64"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown configuration 'fp64'" in r.stderr.strip().splitlines()[-1]


def test_trainer_speed_tool_refuses_a_warm_up_that_leaves_no_step_to_time(capsys):
    from student.train import speed
    with pytest.raises(SystemExit) as e:
        speed.main(["--steps", "4", "--warm", "4"])
    assert e.value.code == 2 and "--warm 4 leaves none of --steps 4 to time" in capsys.readouterr().err


def test_speed_tool_no_cudnn_runs_its_steps_with_cudnn_attention_left_out_and_restores_it(monkeypatch):
    """bf16+no_cudnn: on CUDA the steps run with SDPA's cuDNN backend off (the setting is global),
    torch's choice again after; on a CPU, and without the switch, nothing changes."""
    from torch.nn.attention import SDPBackend
    from student.train import speed
    seen = []
    monkeypatch.setattr(speed, "Trainer", lambda cfg, corpus, device, ddp: None)
    monkeypatch.setattr(speed, "timed", lambda t, steps, warm, device: seen.append(
        (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    for switches, device in ((("no_cudnn",), "cuda"), ((), "cuda"), (("no_cudnn",), "cpu")):
        speed.run(None, None, 4, 1, switches, device)
    assert seen == [(False, True), (True, True), (True, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled()
    backends = speed.attention_backends("cuda", ("no_cudnn",))
    assert SDPBackend.CUDNN_ATTENTION not in backends and SDPBackend.EFFICIENT_ATTENTION in backends  # masks
    assert speed.attention_backends("cpu", ("no_cudnn",)) is None and speed.attention_backends("cuda", ()) is None


def test_speed_tool_times_the_first_steps_apart_from_the_rest(monkeypatch):
    """warm_s_per_step: the steps that meet their shapes first (a cuDNN plan each), beside the rest."""
    import numpy as np
    from types import SimpleNamespace
    from student.train import speed
    calls, clock = [], [0.0]  # a clock of our own: what a step costs is set here, not by the machine's load
    monkeypatch.setattr(speed.time, "perf_counter", lambda: clock[0])

    def step(group):
        calls.append(group)
        clock[0] += 0.05 if len(calls) <= 2 else 0.005
        return 100, 1.0, 0.1
    t = SimpleNamespace(model=torch.nn.Linear(1, 1), cfg=SimpleNamespace(max_tokens=64, max_sentences=8, seed=1),
                        train_lens=(np.full(40, 8, np.int32), np.full(40, 8, np.int32)), step=step)
    r = speed.timed(t, 6, 2, "cpu")
    assert len(calls) == 6 and r["warm_s_per_step"] >= 0.05 and r["s_per_step"] < 0.04
    assert r["tokens_s"] == pytest.approx(400 / (4 * r["s_per_step"]))
