"""`make distill` pieces and the pipeline end to end on a toy corpus: teachers, resumable
shards (kill + rerun, torchrun ranks), keyed stages, teacher errors, the report."""
import dataclasses
import glob
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import ROOT, toy_parallel

TINY = ["--vocab-size", "320", "--amp", "off", "--max-tokens", "400", "--eval-every", "10", "--save-every", "5",
        "--dev-max", "10"]
for _who in ("teacher", "student"):
    TINY += [a for kv in ("d_model=32", "n_heads=2", "ffn_dim=64", "encoder_layers=1", "dropout=0.1")
             for a in (f"--{_who}-set", kv)]

# a teacher program: uppercases each line; switches make it misbehave on its Nth call
TEACHER = textwrap.dedent("""
    import os, sys, time
    args = sys.argv[1:]
    opt = lambda k: args[args.index(k) + 1] if k in args else None
    lines = sys.stdin.read().split("\\n")[:-1]
    log = opt("--log")
    n = 1
    if log:
        n = (sum(1 for _ in open(log)) if os.path.exists(log) else 0) + 1
        with open(log, "a") as fh:
            fh.write(f"{os.environ.get('RANK', '-')}\\t{lines[0] if lines else ''}\\n")
    if opt("--fail-on-call") and n == int(opt("--fail-on-call")):
        sys.stderr.write("teacher: model file missing\\n")
        sys.exit(3)
    if opt("--sleep"):
        time.sleep(float(opt("--sleep")))
    out = [x.upper() for x in lines]
    if opt("--drop-on-call") and n == int(opt("--drop-on-call")):
        out = out[:-1]
    if opt("--add-on-call") and n == int(opt("--add-on-call")):
        out = out + ["EXTRA"]
    sys.stdout.write("".join(x + "\\n" for x in out))
""")


@pytest.fixture()
def env(tmp_path):
    src, tgt = toy_parallel(240, seed=3)
    (tmp_path / "c.en").write_text("\n".join(src) + "\n", encoding="utf-8")
    (tmp_path / "c.es").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    (tmp_path / "teacher.py").write_text(TEACHER, encoding="utf-8")
    return tmp_path


def teacher_cmd(env, *flags):
    return " ".join([sys.executable, str(env / "teacher.py"), *flags])


def distill(env, name, *extra, launcher=None, wait=True, check=True, cores=None):
    e = {**os.environ, "KIT_DATA_DIR": str(env / "data"), "OMP_NUM_THREADS": "1"}
    cmd = (launcher or [sys.executable]) + ["-m", "student.distill", "--runs-dir", str(env / "runs"), "--name", name,
                                            "--src", str(env / "c.en"), "--tgt", str(env / "c.es"), *TINY, *extra]
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    if not wait:  # own session, so the test can kill the teacher subprocess with it
        return subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=pin)
    r = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=600, preexec_fn=pin)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def stage_dir(env, name, stage):
    # keyed stage dirs only: <stage>-<12 hex>, not the links runs/<name>/<stage>-model
    dirs = [d for d in glob.glob(str(env / "runs" / name / f"{stage}-*")) if not d.endswith("-model")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def lines(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read().split("\n")[:-1]


def manifest(env, name):
    return json.load(open(env / "runs" / name / "manifest.json"))


# -- the pipeline ----------------------------------------------------------------------------------

def test_command_teacher_end_to_end_then_rerun_skips_and_changed_option_reruns_only_dependents(env):
    r = distill(env, "up", "--teacher-cmd", teacher_cmd(env), "--shard-size", "50", "--student-steps", "20")
    run = env / "runs" / "up"
    assert "| system | BLEU | chrF | words/s |" in r.stdout and "| student |" in r.stdout  # printed at the end
    rep = json.load(open(run / "report.json"))
    # a command teacher has one search; the KD student is decoded greedy and with the teacher's beam
    assert [s["system"] for s in rep["systems"]] == ["teacher", "student", "student"]
    assert [s["beam"] for s in rep["systems"][1:]] == [1, 4]
    for s in rep["systems"]:
        assert s["words_per_second"] > 0 and "nrefs:1|" in s["bleu_signature"]
    assert rep["systems"][1]["size_params"] > 0 and rep["systems"][1]["size_bytes"] > 0
    assert (run / "report.md").read_text() == open(os.path.join(stage_dir(env, "up", "report"), "report.md")).read()
    # the dev-BLEU curves of the runs trained here, beside report.md, when they had a dev evaluation
    assert (run / "dev-bleu.png").exists() == any(t["dev_bleu"] for t in rep["training"].values())

    train_src = lines(os.path.join(stage_dir(env, "up", "data"), "train.src"))
    distilled = lines(os.path.join(stage_dir(env, "up", "distill"), "distilled.txt"))
    assert distilled == [x.upper() for x in train_src]
    from decoder import modeldir
    modeldir.load(str(run / "student-model"))  # the exported student is a valid model dir
    cfg = modeldir.read_config(str(run / "student-model"))  # ... with its lexical shortlist
    assert modeldir.read_shortlist(str(run / "student-model"), cfg)[1].numel() > 0

    m = manifest(env, "up")
    assert set(m["stages"]) == {"data", "distill", "corpus", "student", "shortlist", "report"}
    assert all(s["status"] == "ran" and len(s["key"]) == 12 for s in m["stages"].values())
    assert m["versions"]["torch"] == importlib.metadata.version("torch") and m["versions"]["sacrebleu"]
    assert m["config"]["teacher_cmd"] == teacher_cmd(env) and m["inputs"]["src"]

    r = distill(env, "up", "--teacher-cmd", teacher_cmd(env), "--shard-size", "50", "--student-steps", "20")
    assert all(s["status"] == "reused" for s in manifest(env, "up")["stages"].values())
    assert r.stderr.count("up to date") == 6

    distill(env, "up", "--teacher-cmd", teacher_cmd(env), "--shard-size", "50", "--student-steps", "25")
    st = {k: v["status"] for k, v in manifest(env, "up")["stages"].items()}
    assert st == {"data": "reused", "distill": "reused", "corpus": "reused", "student": "ran", "shortlist": "ran",
                  "report": "ran"}
    assert len(glob.glob(str(run / "student-*"))) == 3  # two keyed student dirs + the student-model link


@pytest.mark.skipif(not shutil.which("apertium"), reason="apertium is not installed (apt-get install apertium-eng-spa)")
def test_apertium_teacher_end_to_end_with_baseline_student(env):
    distill(env, "apertium", "--teacher-cmd", "apertium -u eng-spa", "--student-steps", "15", "--baseline-student")
    rep = json.load(open(env / "runs" / "apertium" / "report.json"))
    assert [s["system"] for s in rep["systems"]] == ["teacher", "student", "student", "baseline"]
    teacher = rep["systems"][0]
    # the toy words translate word for word: a real translator scores well above zero
    assert teacher["engine"] == "external" and teacher["chrf"] > 30
    distilled = lines(os.path.join(stage_dir(env, "apertium", "distill"), "distilled.txt"))
    assert "el" in " ".join(distilled).lower().split()


def test_own_teacher_exports_its_best_dev_candidate_including_the_steps_after_the_last_evaluation(env):
    # 33 steps, evaluations every 10, step checkpoints every 5: the last evaluation is at step 30
    # a 33-step teacher translates badly: cleaning keeps its output and the run goes on (a dev BLEU of 0,
    # a sixth of its output kept), this test is about the mechanics
    distill(env, "own", "--teacher-steps", "33", "--average-last", "3", "--teacher-beam", "2",
            "--shard-size", "100", "--student-steps", "10", "--test-limit", "10", "--min-ratio", "0",
            "--max-ratio", "1000", "--max-repeat", "1000", "--min-teacher-bleu", "0", "--min-kept", "0")
    run = env / "runs" / "own"
    m = manifest(env, "own")
    teacher = m["stages"]["teacher"]["result"]
    export = teacher["export"]
    cands = {c["name"]: c for c in export["candidates"]}
    assert [c["name"] for c in export["candidates"]][:3] == ["last", "avg-2", "avg-3"]
    assert cands["last"]["steps"] == [33] and cands["avg-2"]["steps"] == [30, 33]
    assert cands["avg-3"]["steps"] == [25, 30, 33]  # every average ends at the final step
    assert export["chosen"] == max(export["candidates"], key=lambda c: c["dev_bleu"])["name"]
    assert all(isinstance(c["dev_bleu"], float) for c in export["candidates"])
    tdir = stage_dir(env, "own", "teacher")
    chosen = cands[export["chosen"]]
    ck = f"{tdir}/train/{chosen['name']}.pt" if len(chosen["steps"]) == 1 else f"{tdir}/candidates/{chosen['name']}.pt"
    from safetensors.torch import load_file
    want = torch.load(ck, weights_only=True)["model"]
    got = load_file(str(run / "teacher-model" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k].float()) for k in got)  # the exported weights are the chosen ones
    assert teacher["step"] == 33 and os.path.isdir(run / "teacher-model")
    assert m["stages"]["distill"]["upstream"][1] == m["stages"]["teacher"]["key"]
    n = len(lines(os.path.join(stage_dir(env, "own", "data"), "train.src")))
    assert len(lines(os.path.join(stage_dir(env, "own", "distill"), "distilled.txt"))) == n
    distilled = m["stages"]["distill"]["result"]  # the decoder's fastest configuration, and its speed
    assert distilled["precision"] in ("fp32", "int8") and distilled["workers"] == (
        len(os.sched_getaffinity(0)) if len(os.sched_getaffinity(0)) > 1 else 0)
    assert distilled["rank0"]["words_per_second"] > 0
    rep = json.load(open(run / "report.json"))
    rows = [(r["system"], r["beam"], r["headline"]) for r in rep["systems"]]
    assert rows == [("teacher", 2, True), ("teacher", 1, False), ("student", 1, True), ("student", 2, False)]
    assert rep["systems"][0]["size_params"] > rep["systems"][2]["size_params"]
    t = {r["beam"]: r["words_per_second"] for r in rep["systems"][:2]}
    for r in rep["systems"][2:]:  # each student row against the teacher row with its search
        assert r["over_teacher_words_s"] == round(r["words_per_second"] / t[r["beam"]], 2)
    assert rep["summary"]["student_over_teacher_words_s"] == round(
        rep["systems"][2]["words_per_second"] / rep["systems"][0]["words_per_second"], 2)
    assert {"teacher", "student"} <= set(rep["training"])


def test_kill_during_distillation_then_rerun_loses_and_duplicates_no_shard(env):
    common = ["--shard-size", "10", "--student-steps", "5", "--test-limit", "5"]
    distill(env, "ref", "--teacher-cmd", teacher_cmd(env), *common)
    log = env / "calls.log"
    cmd = teacher_cmd(env, "--sleep", "0.3", "--log", str(log))
    p = distill(env, "killed", "--teacher-cmd", cmd, *common, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if len(glob.glob(str(env / "runs" / "killed" / "distill-*" / "shards" / "shard-*.txt"))) >= 3:
            break
        time.sleep(0.05)
    assert p.poll() is None, p.stdout.read().decode()[-3000:]
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    shard_dir = os.path.join(stage_dir(env, "killed", "distill"), "shards")
    before = sorted(os.listdir(shard_dir))
    n_shards = len(glob.glob(os.path.join(stage_dir(env, "ref", "distill"), "shards", "shard-*.txt")))
    assert 3 <= len([f for f in before if f.endswith(".txt")]) < n_shards
    calls_before = len(lines(log))

    distill(env, "killed", "--teacher-cmd", cmd, *common)
    ref = lines(os.path.join(stage_dir(env, "ref", "distill"), "distilled.txt"))
    assert lines(os.path.join(stage_dir(env, "killed", "distill"), "distilled.txt")) == ref
    done_before = len([f for f in before if f.endswith(".txt")])
    # the rerun translated exactly the missing shards (plus the report's test split, one call)
    assert len(lines(log)) - calls_before == n_shards - done_before + 1
    assert calls_before - done_before in (0, 1)  # at most the shard being translated when killed
    assert not [f for f in os.listdir(shard_dir) if ".tmp" in f]


def test_two_torchrun_ranks_each_translate_their_own_shards(env):
    log = env / "calls.log"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
    distill(env, "ddp", "--teacher-cmd", teacher_cmd(env, "--log", str(log)), "--shard-size", "20",
            "--student-steps", "6", "--test-limit", "5", launcher=launcher)
    src = lines(os.path.join(stage_dir(env, "ddp", "data"), "train.src"))
    first_line = {src[i]: i // 20 for i in range(0, len(src), 20)}
    calls = [x.split("\t", 1) for x in lines(log)]
    shard_calls = [(int(rank), first_line[first]) for rank, first in calls if first in first_line]
    assert sorted(s for _, s in shard_calls) == list(range(len(first_line)))  # each shard once
    assert all(rank == shard % 2 for rank, shard in shard_calls)
    assert lines(os.path.join(stage_dir(env, "ddp", "distill"), "distilled.txt")) == [x.upper() for x in src]
    assert manifest(env, "ddp")["stages"]["distill"]["result"]["world"] == 2


# -- the two students side by side ---------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped running
    except FileNotFoundError:
        return False


def _tensors(model_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="side by side needs 2 cores")
def test_students_side_by_side_give_the_sequential_weights_on_disjoint_cores_and_resume_after_a_kill(env):
    # Both variants are pinned to two cores and OMP_NUM_THREADS=1: the sequential students then
    # train on 1 torch thread, as each side-by-side child (1 core each). Bit equality is only
    # promised at equal thread counts: intra-op threads split reductions, which rounds differently
    # (student-tiny, one batch: 34 of 127 gradient tensors differ between 1 and 2 threads, by up to 8e-8).
    two = sorted(os.sched_getaffinity(0))[:2]
    common = ["--teacher-cmd", teacher_cmd(env), "--baseline-student", "--student-steps", "100",
              "--shortlist-k", "0", "--test-limit", "5"]
    distill(env, "seq", *common, "--no-side-by-side", cores=two)
    seq = manifest(env, "seq")
    assert seq["students"] == {"side_by_side": False, "reason": "--no-side-by-side", "cores": {}}
    assert seq["config"]["side_by_side"] is False

    p = distill(env, "side", *common, wait=False, cores=two)
    deadline = time.time() + 400
    while time.time() < deadline and p.poll() is None:
        if all(glob.glob(str(env / "runs" / "side" / f"{s}-*" / "train" / "last.pt")) for s in ("student", "baseline")):
            break
        time.sleep(0.05)
    assert p.poll() is None, p.stdout.read().decode()[-3000:]
    os.kill(p.pid, signal.SIGKILL)  # the parent alone: its children must not train on
    p.wait()
    pids, dirs = [], {s: stage_dir(env, "side", s) for s in ("student", "baseline")}  # no model links yet
    # killed once both had a last.pt: at least one mid-training (the other may be through on a busy machine)
    assert not all(os.path.exists(f"{d}/train/metrics.json") for d in dirs.values())
    for d in dirs.values():
        pids += [int(x.rsplit("pid ", 1)[1]) for x in lines(f"{d}/train.log") if x.startswith("pinned")]
    assert len(pids) == 2
    deadline = time.time() + 30
    while time.time() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    assert not any(map(_alive, pids))

    r = distill(env, "side", *common, cores=two)
    for s in ("student", "baseline"):  # each from its own last.pt, relayed to the parent's log
        assert f"[{s}] resuming from {dirs[s]}/train/last.pt" in r.stderr
    side = manifest(env, "side")
    assert side["config"]["side_by_side"] is True and side["students"]["side_by_side"] is True
    got = {s: side["stages"][s]["result"]["side_by_side"] for s in ("student", "baseline")}
    assert set(got["student"]["cores"]).isdisjoint(got["baseline"]["cores"])
    assert all(g["cores"] and set(g["cores"]) <= set(two) and g["threads"] == 1 for g in got.values())
    assert got["student"]["beside"] == ["baseline"]
    for s in ("student", "baseline"):
        assert side["stages"][s]["key"] == seq["stages"][s]["key"]  # the option is no part of the key
        a, b = _tensors(env / "runs" / "seq" / f"{s}-model"), _tensors(env / "runs" / "side" / f"{s}-model")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), s
    assert side["stages"]["student"]["result"]["step"] == 100


def test_students_train_one_after_the_other_on_a_gpu_with_torchrun_on_one_core_or_when_one_is_done():
    from student.distill.side import split_cores
    assert split_cores(True, 2, False, 1, False, {0, 1}) == ([[0], [1]], None)
    assert split_cores(True, 2, False, 1, False, {4, 5, 6}) == ([[4, 5], [6]], None)
    assert split_cores(False, 2, False, 1, False, {0, 1}) == ([], "--no-side-by-side")
    assert split_cores(True, 1, False, 1, False, {0, 1}) == ([], "fewer than two students left to train")
    assert split_cores(True, 2, True, 1, False, {0, 1}) == ([], "a GPU trains them")
    assert split_cores(True, 2, False, 2, False, {0, 1})[1] == "torchrun ranks (NPROC>1) train them"
    assert split_cores(True, 2, False, 1, True, {0, 1})[1] == "torchrun ranks (NPROC>1) train them"
    assert split_cores(True, 2, False, 1, False, {3}) == ([], "one core")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="side by side needs 2 cores")
def test_a_failing_student_stops_the_one_beside_it_and_the_error_names_its_stage(env, monkeypatch):
    import multiprocessing as mp
    from student.data import prepare
    from student.distill.side import StudentTrainingError, train_side_by_side
    from student.train import TrainConfig
    monkeypatch.setenv("KIT_DATA_DIR", str(env / "data"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prepare(src=str(env / "c.en"), tgt=str(env / "c.es"), vocab_size=320, verbose=False)  # the children's cache
    good = TrainConfig(out_dir=str(env / "good"), preset="student-tiny", src=str(env / "c.en"), tgt=str(env / "c.es"),
                       vocab_size=320, max_tokens=400, eval_every=0, save_every=0, test_at_end=False,
                       model_overrides=dict(d_model=32, n_heads=2, ffn_dim=64, encoder_layers=1))
    bad = dataclasses.replace(good, out_dir=str(env / "bad"), train_src=str(env / "missing.src"),
                              train_tgt=str(env / "missing.tgt"))
    two = sorted(os.sched_getaffinity(0))[:2]
    with pytest.raises(StudentTrainingError) as e:  # `good` has no step limit: it trains until stopped
        train_side_by_side([("student", good, str(env / "good.log")), ("baseline", bad, str(env / "bad.log"))],
                           [two[:1], two[1:]], lambda msg: None)
    msg = str(e.value)
    assert msg.startswith("[baseline] training failed: DataError: ") and "missing.src" in msg and "\n" not in msg
    assert msg.endswith("; stopped student beside it") and str(env / "bad.log") in msg
    assert mp.active_children() == []
    assert "Traceback" in (env / "bad.log").read_text()  # the whole story is in the stage's log


# -- teacher errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,got", [("--drop-on-call", 9), ("--add-on-call", 11)])
def test_teacher_changing_the_line_count_fails_naming_the_shard(env, flag, got):
    r = distill(env, "bad", "--teacher-cmd", teacher_cmd(env, flag, "2", "--log", str(env / "log")),
                "--shard-size", "10", "--student-steps", "5", check=False)
    assert r.returncode == 2
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in r.stderr
    assert f"wrote {got} lines for 10 input lines on shard 1 (lines 11-20)" in err[0]
    shards = os.path.join(stage_dir(env, "bad", "distill"), "shards")
    assert sorted(os.listdir(shards)) == ["shard-00000.txt"]  # the good shard is kept for the rerun


def test_teacher_exiting_nonzero_fails_with_its_status_and_stderr(env):
    r = distill(env, "fail", "--teacher-cmd", teacher_cmd(env, "--fail-on-call", "1", "--log", str(env / "log")),
                "--student-steps", "5", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1
    assert "exited with status 3 on shard 0" in err[0] and "teacher: model file missing" in err[0]


# -- the teacher's export ------------------------------------------------------------------------------

def _fake_run(tiny_spm, d, final: int, steps: list[int], best: int):
    """A run dir like the trainer's: ckpt-STEP.pt, last.pt (step `final`) and best.pt,
    each a tiny model whose every weight is its step number."""
    from student.model import Transformer, preset
    m = Transformer(preset("student-tiny", vocab_size=64, d_model=16, n_heads=2, ffn_dim=32, encoder_layers=1,
                           decoder_layers=1, dropout=0.0))
    os.makedirs(d, exist_ok=True)
    meta = {"spm_model": tiny_spm, "src_lang": "en", "tgt_lang": "es", "normaliser": {}}
    for name, step in [*((f"ckpt-{s:07d}.pt", s) for s in steps), ("last.pt", final), ("best.pt", best)]:
        sd = {k: torch.full_like(v, float(step)) for k, v in m.state_dict().items()}
        torch.save({"model": sd, "model_args": dataclasses.asdict(m.args), "meta": meta, "step": step,
                    "optimizer": {}, "scaler": None}, os.path.join(d, name))


def test_export_candidates_are_the_final_weights_and_averages_ending_at_the_final_step(tiny_spm, tmp_path):
    from student.train.average import candidates
    _fake_run(tiny_spm, tmp_path, final=635, steps=[300, 400, 500, 600], best=400)
    got = [(c["name"], c["steps"]) for c in candidates(str(tmp_path), 4)]
    assert got == [("last", [635]), ("avg-2", [600, 635]), ("avg-4", [400, 500, 600, 635]), ("best", [400])]
    # a step checkpoint at the final step is the final weights: never averaged in twice
    _fake_run(tiny_spm, tmp_path / "b", final=600, steps=[500, 600], best=600)
    assert [(c["name"], c["steps"]) for c in candidates(str(tmp_path / "b"), 4)] == [
        ("last", [600]), ("avg-2", [500, 600])]


def test_the_teacher_stage_exports_the_candidate_with_the_highest_dev_bleu(tiny_spm, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from student.distill import pipeline
    _fake_run(tiny_spm, tmp_path / "train", final=635, steps=[300, 400, 500, 600], best=400)
    injected = {"last": 5.0, "avg-2": 7.5, "avg-4": 7.0, "best": 7.5}  # a tie goes to the earlier one
    monkeypatch.setattr(pipeline, "dev_bleu", lambda path, src, ref, work: injected[
        os.path.basename(path).removesuffix(".pt")])

    class Prep:
        def read(self, split):
            assert split == "dev"
            return ["a"] * 5, ["b"] * 5

    p = object.__new__(pipeline.Pipeline)
    p.cfg, p.prep, p.log = pipeline.DistillConfig(average_last=4, dev_max=3), Prep(), lambda m: None
    export = p.export_best(str(tmp_path / "train"), str(tmp_path / "model"))
    assert export["chosen"] == "avg-2" and export["averaged_from"] == ["ckpt-0000600.pt", "last.pt"]
    assert [(c["name"], c["dev_bleu"]) for c in export["candidates"]] == list(injected.items())
    assert export["dev_sentences"] == 3
    w = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert all(torch.all(v == (600 + 635) / 2) for v in w.values())  # the mean of steps 600 and 635


# -- teachers and search as a library ----------------------------------------------------------------

def _random_model_dir(tiny_spm, out, seed):
    from student.modeldir import write_model_dir
    from student.model import Transformer, preset
    torch.manual_seed(seed)
    m = Transformer(preset("student-tiny", vocab_size=64, d_model=32, n_heads=2, ffn_dim=64, encoder_layers=2,
                           decoder_layers=2, dropout=0.0))
    meta = {"src_lang": "en", "tgt_lang": "es", "normaliser": {"type": "moses-punct", "src_lang": "en",
            "tgt_lang": "es", "penn": True, "norm_quote_commas": True, "norm_numbers": True,
            "pre_replace_unicode_punct": True, "post_remove_control_chars": True}}
    return write_model_dir(m, tiny_spm, str(out), meta), m.eval()


def test_reference_search_with_beam_one_is_exactly_the_training_models_greedy(tiny_spm, tmp_path):
    from student.distill.beam import EnsembleSearch
    from student.train.batching import collate
    _, model = _random_model_dir(tiny_spm, tmp_path / "m", 0)
    src, _ = toy_parallel(12, seed=5)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=tiny_spm)
    ids = [sp.encode(x) + [2] for x in src]
    s, _, _ = collate(ids, None, range(len(ids)), 1, 2, 2)
    ref = model.greedy(s)
    assert all(1 not in r for r in ref)  # greedy never chose padding, so the searches are comparable
    assert EnsembleSearch([model], beam=1)(s) == ref


def test_a_model_teacher_distils_at_the_decoders_auto_precision_with_one_worker_per_core(tiny_spm, tmp_path,
                                                                                          monkeypatch):
    from decoder.translator import resolve_device_precision
    from student.distill import teachers
    d, _ = _random_model_dir(tiny_spm, tmp_path / "m", 0)
    monkeypatch.setattr(teachers.os, "sched_getaffinity", lambda pid: {0, 1})
    t = teachers.make_teacher(model_dirs=[d], beam=3, device="cpu")
    auto = resolve_device_precision("cpu", "auto")[1]
    assert (t.precision, t.workers, t.identity["precision"]) == (auto, 2, auto)  # the key names what runs
    assert teachers.make_teacher(model_dirs=[d], beam=3, device="cpu", world=2).workers == 0  # a core per rank
    # workers do not change the output: fp32 in 2 worker processes is today's one-process fp32 beam
    src, _ = toy_parallel(40, seed=8)
    one = teachers.ModelTeacher([d], beam=3, engine="decoder", device="cpu", precision="fp32").translate(src)
    two = teachers.ModelTeacher([d], beam=3, engine="decoder", device="cpu", precision="fp32", workers=2)
    try:
        assert two.translate(src) == one and two.engine_label() == "decoder fp32, 2 workers"
    finally:
        two.close()


def test_report_rows_start_worker_processes_only_where_the_test_split_gives_each_its_lines(tiny_spm, tmp_path,
                                                                                            monkeypatch):
    from types import SimpleNamespace
    from student.distill import report, teachers
    d, _ = _random_model_dir(tiny_spm, tmp_path / "m", 0)
    monkeypatch.setattr(teachers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    teacher = teachers.make_teacher(model_dirs=[d], beam=3, device="cpu")  # as it distilled: a worker per core
    cfg = SimpleNamespace(teacher_beam=3, student_beam=1, engine="decoder", precision="fp32")

    def rows(lines):
        return report.searches("teacher", teacher, cfg, lines) + report.searches("student", d, cfg, lines)

    def workers(lines):
        return [(label, t.beam, t.workers) for label, t, _ in rows(lines)]

    per = teachers.WORKER_MIN_LINES
    labels = [("teacher", 3), ("teacher.greedy", 1), ("student", 1), ("student.beam3", 3)]
    assert workers(4 * per) == [(x, b, 4) for x, b in labels]
    assert rows(4 * per)[0][1] is teacher  # the headline is the teacher that distilled
    assert workers(3 * per + per // 2) == [(x, b, 3) for x, b in labels]  # no worker without its share
    # a smoke run's split (or --test-limit): one process, every row alike, the teacher's precision kept
    assert workers(2 * per - 1) == workers(12) == [(x, b, 0) for x, b in labels]
    headline = rows(12)[0][1]
    assert headline is not teacher and (headline.dirs, headline.precision) == (teacher.dirs, teacher.precision)
    assert [h for _, _, h in rows(12)] == [True, False, True, False]
    assert teachers.workers_for(10**6, 0) == 0 and teachers.workers_for(10**6, 2) == 2


def test_ensemble_averages_member_log_probabilities_per_step(tiny_spm, tmp_path):
    from student.distill.beam import EnsembleSearch
    from student.distill.teachers import ModelTeacher
    from student.train.batching import collate
    da, a = _random_model_dir(tiny_spm, tmp_path / "a", 0)
    db, b = _random_model_dir(tiny_spm, tmp_path / "b", 1)
    shutil.copytree(da, tmp_path / "a2")
    src, _ = toy_parallel(10, seed=6)
    src[3] = ""
    one = ModelTeacher([da], beam=3, engine="reference").translate(src)
    assert ModelTeacher([da, str(tmp_path / "a2")], beam=3, engine="reference").translate(src) == one
    assert one[3] == "" and len(one) == len(src)

    # greedy over the mean of the members' log-softmax, recomputing the prefix: the ensemble's definition
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=tiny_spm)
    ids = [sp.encode(x) + [2] for x in src if x]
    s, _, _ = collate(ids, None, range(len(ids)), 1, 2, 2)
    got = EnsembleSearch([a, b], beam=1)(s)
    with torch.no_grad():
        ea, eb = a.encode(s), b.encode(s)
        limit = torch.clamp(((s != 1).sum(1).float() * 1.5 + 10).long(), max=1023)
        ys = torch.full((len(ids), 1), 2, dtype=torch.long)
        done = torch.zeros(len(ids), dtype=torch.bool)
        for t in range(int(limit.max())):
            lp = (torch.log_softmax(a.decode(ys, *ea)[:, -1], -1) + torch.log_softmax(b.decode(ys, *eb)[:, -1], -1)) / 2
            lp[:, 1] = float("-inf")
            nxt = torch.where(done, 1, torch.where(t + 1 >= limit, 2, lp.argmax(-1)))
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt == 2
            if done.all():
                break
    want = [r[:r.index(2)] if 2 in r else r for r in ys[:, 1:].tolist()]
    assert got == want
    assert got != EnsembleSearch([a], beam=1)(s) or got != EnsembleSearch([b], beam=1)(s)


def marian_spm(tmp_path):
    """(src, tgt, SentencePiece model) of the toy corpus in Marian's id layout:
    </s>=0, <pad>=1, <unk>=2 (only eos/pad/unk matter to its tokenizer)."""
    import sentencepiece as spm
    src, tgt = toy_parallel(300)
    (tmp_path / "text.txt").write_text("\n".join(src + tgt) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "spm"),
                                   vocab_size=64, bos_id=-1, eos_id=0, pad_id=1, unk_id=2, minloglevel=2,
                                   num_threads=1)
    return src, tgt, spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))


def tiny_marian(tmp_path, sp, vocab: dict, **cfg):
    """A random 1+1-layer MarianMTModel and its tokenizer over `vocab`, saved to tmp_path/marian."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    tok = MarianTokenizer(source_spm=str(tmp_path / "spm.model"), target_spm=str(tmp_path / "spm.model"),
                          vocab=str(tmp_path / "vocab.json"))
    torch.manual_seed(0)
    model = MarianMTModel(MarianConfig(
        vocab_size=len(vocab), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
        **cfg)).eval()
    model.save_pretrained(tmp_path / "marian")
    tok.save_pretrained(tmp_path / "marian")
    return tmp_path / "marian", tok, model


def test_hf_marian_teacher_translates_every_line_offline(tmp_path):
    pytest.importorskip("transformers")
    from transformers import MarianMTModel
    from student.distill.teachers import HFTeacher, make_teacher
    src, tgt, sp = marian_spm(tmp_path)
    out, _, _ = tiny_marian(tmp_path, sp, {sp.id_to_piece(i): i for i in range(sp.get_piece_size())})

    teacher = make_teacher(hf_dir=str(out), beam=2)
    assert isinstance(teacher, HFTeacher)
    lines_in = src[:7] + [""] + src[7:12]
    got = teacher.translate(lines_in)
    assert len(got) == len(lines_in) and got[7] == "" and all(got[i] for i in range(len(got)) if i != 7)
    assert teacher.translate(lines_in) == got  # beam search is deterministic
    assert teacher.size()["params"] == sum(p.numel() for p in MarianMTModel.from_pretrained(out).parameters())


# -- pieces ------------------------------------------------------------------------------------------

def test_ranks_partition_the_shards_round_robin(tmp_path):
    from student.distill.shards import missing_shards, write_atomic, shard_path
    assert [missing_shards(str(tmp_path), 95, 10, r, 3) for r in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    write_atomic(shard_path(str(tmp_path), 3), ["x"] * 10)
    assert missing_shards(str(tmp_path), 95, 10, 0, 3) == [0, 6, 9]


def test_cleaning_drops_empty_punctuation_only_copied_repetitive_and_length_ratio_outliers():
    from student.distill.filter import clean_distilled
    src = ["the man sees the dog", "the red house", "a big city", "the king has a word",
           "the dog", "a small cat sees the old woman", "the house\u2028is red", "the cat", "\u2014 1:2",
           "\u2014"]
    hyp = ["el hombre ve el perro", "", "a big city", "el rey el rey el rey el rey el rey tiene",
           "el perro es un perro grande y viejo y rojo", "gato", "la casa es roja", ",,,, _", "\u2014 1:2",
           "\u2014"]
    s, h, counts = clean_distilled(src, hyp)
    # an output of only punctuation is empty of translation; a source of only punctuation may keep it
    assert counts == {"empty": 2, "copy": 1, "repetitive": 1, "ratio": 2, "kept": 4}
    # line separators never reach the corpus
    assert s == ["the man sees the dog", "the house is red", "\u2014 1:2", "\u2014"]
    assert h == ["el hombre ve el perro", "la casa es roja", "\u2014 1:2", "\u2014"]


def test_report_verdict_says_by_how_much_the_student_misses_and_whether_it_was_still_learning():
    from student.distill.report import verdict
    rows = [{"system": "teacher", "bleu": 17.9}, {"system": "student", "bleu": 12.4},
            {"system": "baseline", "bleu": 9.0}]
    training = {"student": {"steps": 800, "minutes": 45.2, "stop_reason": "max_steps", "dev_bleu": [3.1, 11.0],
                            "dev_steps": [400, 800]},
                "baseline": {"steps": 800, "minutes": 44.0, "stop_reason": "max_steps", "dev_bleu": [5.0, 4.0],
                             "dev_steps": [400, 800]}}
    v = verdict(rows, training)
    assert v[0] == "KD student vs teacher: -5.50 BLEU (misses the 1.0 target)."
    assert v[1].startswith("KD student vs the same student without KD: +3.40 BLEU (distillation helps")
    assert "still rising" in v[2] and "still rising" not in v[3]
    # which budget stopped it, and whether that budget was the limit
    assert "stopped by the step budget (--student-steps)" in v[2] and "the step budget (--student-steps) limited it" in v[2]
    assert "levelled off" in v[3] and "not the budget" in v[3]
    training["student"]["stop_reason"] = "max_minutes"
    assert "the time budget (--student-minutes) limited it" in verdict(rows, training)[2]
    assert verdict([{"system": "teacher", "bleu": 10.0}, {"system": "student", "bleu": 9.6}], {})[0].endswith(
        "(within the 1.0 target and the 0.5 stretch).")
    assert verdict([{"system": "teacher", "bleu": 10.0}, {"system": "student", "bleu": 9.2}], {})[0].endswith(
        "(within the 1.0 target, not the 0.5 stretch).")


def test_report_compares_each_student_row_with_the_teacher_row_of_the_same_search():
    from student.distill.report import add_speed_ratios, summary, verdict
    rows = [{"system": "teacher", "beam": 4, "headline": True, "bleu": 18.0, "words_per_second": 400.0},
            {"system": "teacher", "beam": 1, "headline": False, "bleu": 17.0, "words_per_second": 1000.0},
            {"system": "student", "beam": 1, "headline": True, "bleu": 17.5, "words_per_second": 3000.0},
            {"system": "student", "beam": 4, "headline": False, "bleu": 0.5, "words_per_second": 1200.0}]
    add_speed_ratios(rows)
    assert [r.get("over_teacher_words_s") for r in rows] == [None, None, 3.0, 3.0]
    assert summary(rows) == {"teacher_bleu": 18.0, "student_bleu": 17.5, "student_over_teacher_words_s": 7.5}
    v = verdict(rows, {})
    # the headline rows are compared (a non-headline row's BLEU is no verdict on the student)
    assert v[0] == "KD student vs teacher: -0.50 BLEU (within the 1.0 target and the 0.5 stretch)."
    assert v[1] == ("Speed: the student (greedy) translates 7.5x the teacher's (beam 4) words/s; "
                    "at the same search: greedy 3.0x, beam 4 3.0x.")
    rows[2]["bleu"] = 0.3  # a student that failed to learn is never within the aim
    assert "within" not in " ".join(verdict(rows, {}))


def _tiny_m2m100_dir(tmp_path, seed: int = 0):
    """A random M2M100 with its own M2M100Tokenizer (vocab.json + spm, language tokens __xx__)."""
    import sentencepiece as spm
    from transformers import M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer
    src, tgt = toy_parallel(300)
    (tmp_path / "text.txt").write_text("\n".join(src + tgt) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "spm"),
                                   vocab_size=64, bos_id=0, pad_id=1, eos_id=2, unk_id=3, minloglevel=2,
                                   num_threads=1)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    (tmp_path / "vocab.json").write_text(json.dumps({sp.id_to_piece(i): i for i in range(sp.get_piece_size())}))
    tok = M2M100Tokenizer(vocab_file=str(tmp_path / "vocab.json"), spm_file=str(tmp_path / "spm.model"),
                          src_lang="en", tgt_lang="es")
    torch.manual_seed(seed)
    cfg = M2M100Config(vocab_size=max(tok.lang_token_to_id.values()) + 1 + 8, d_model=16,  # + madeup words encoder_layers=1, decoder_layers=1,
                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                       decoder_ffn_dim=32, max_position_embeddings=64, init_std=0.3)
    out = tmp_path / "m2m100"
    model = M2M100ForConditionalGeneration(cfg).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, model, tok


def test_hf_m2m100_teacher_forces_the_target_language_token(tmp_path):
    pytest.importorskip("transformers")
    from student.distill.teachers import HFTeacher, make_teacher
    out, model, tok = _tiny_m2m100_dir(tmp_path)
    teacher = make_teacher(hf_dir=str(out), beam=2)
    assert isinstance(teacher, HFTeacher)
    teacher.set_languages("en", "es")
    lines = toy_parallel(6, seed=3)[0]
    got = teacher.translate(lines)
    # the plain transformers call for M2M100: source language on the tokenizer, target forced first
    tok.src_lang = "en"
    enc = tok(sorted(lines, key=len), return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = model.generate(**enc, num_beams=2, max_new_tokens=62, forced_bos_token_id=tok.get_lang_id("es"))
    assert (gen[:, 1] == tok.get_lang_id("es")).all() and (enc["input_ids"][:, 0] == tok.get_lang_id("en")).all()
    want = dict(zip(sorted(lines, key=len), (" ".join(y.split()) for y in tok.batch_decode(gen, skip_special_tokens=True))))
    assert got == [want[x] for x in lines]
    assert teacher.identity["langs"] == ["en", "es"]


def test_hf_teacher_without_a_token_for_the_language_is_a_teacher_error(tmp_path):
    pytest.importorskip("transformers")
    from student.distill.teachers import TeacherError, make_teacher
    out, _, _ = _tiny_m2m100_dir(tmp_path)
    teacher = make_teacher(hf_dir=str(out), beam=1)
    teacher.set_languages("en", "xx")
    with pytest.raises(TeacherError, match="no language token for 'xx'"):
        teacher.translate(["the dog"])


def test_hf_multi_target_marian_teacher_prefixes_the_target_token(tmp_path):
    pytest.importorskip("transformers")
    from student.distill.teachers import make_teacher
    src, tgt, sp = marian_spm(tmp_path)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    vocab.update({">>es<<": len(vocab), ">>fr<<": len(vocab) + 1})  # as opus-mt-en-ROMANCE has them
    _, tok, model = tiny_marian(tmp_path, sp, vocab, init_std=0.3)
    teacher = make_teacher(hf_dir=str(tmp_path / "marian"), beam=1)
    teacher.set_languages("en", "es")
    lines = toy_parallel(5, seed=4)[0]
    got = teacher.translate(lines)
    enc = tok([">>es<< " + x for x in lines], return_tensors="pt", padding=True)
    assert (enc["input_ids"][:, 0] == vocab[">>es<<"]).all()
    with torch.no_grad():
        want = [" ".join(tok.decode(model.generate(**tok([">>es<< " + x], return_tensors="pt"), num_beams=1,
                                                    max_new_tokens=62)[0], skip_special_tokens=True).split())
                for x in lines]
    assert got == want


def test_report_stage_table_gives_the_distill_stage_words_per_second():
    from student.distill.report import markdown, stage_note
    result = {"sentences": 29255, "world": 1, "engine": "decoder", "precision": "int8", "workers": 2,
              "rank0": {"sentences": 29255, "words": 704941, "seconds": 295.27, "words_per_second": 2387.4}}
    note = stage_note(result)
    assert note == ("29255 sentences, 2387 words/s, 99.1 sentences/s (decoder, int8, 2 workers; rank 0 of 1)")
    assert stage_note({"steps": 10}) is None and stage_note(None) is None  # training stages: nothing to add
    rep = {"run": "x", "test": {"sentences": 1, "words": 1, "pair": "en-es", "set": "a book"}, "machine": "m",
           "lean_decoder": True, "systems": [], "verdict": [],
           "stages": {"distill": {"status": "ran", "seconds": 298.0, "note": note}}}
    assert f"| distill | ran | 298.0 | {note} |" in markdown(rep)
