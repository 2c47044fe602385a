"""The user's own dev and test sets (e.g. a newstest) in student.data, student.train and
student.distill: before, with one's own corpus, dev and test were random 5% slices of it."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, toy_parallel
from test_distill import distill, env, teacher_cmd  # noqa: F401 (fixture)
from test_train import metrics, run_train


def write_pair(d, name, n, seed):
    src, tgt = toy_parallel(n, seed=seed)
    (d / f"{name}.en").write_text("\n".join(src) + "\n", encoding="utf-8")
    (d / f"{name}.es").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return src, tgt


def own_sets(d) -> list[str]:
    return ["--dev-src", str(d / "mydev.en"), "--dev-tgt", str(d / "mydev.es"),
            "--test-src", str(d / "mytest.en"), "--test-tgt", str(d / "mytest.es")]


def test_prepare_uses_the_given_dev_and_test_and_trains_on_the_whole_corpus(toy_files, tmp_path):
    from student.data import prepare
    dev = write_pair(tmp_path, "mydev", 17, seed=11)
    test = write_pair(tmp_path, "mytest", 23, seed=12)
    p = prepare(src=str(toy_files / "train.en"), tgt=str(toy_files / "train.es"), src_lang="en", tgt_lang="es",
                dev_src=str(tmp_path / "mydev.en"), dev_tgt=str(tmp_path / "mydev.es"),
                test_src=str(tmp_path / "mytest.en"), test_tgt=str(tmp_path / "mytest.es"),
                vocab_size=320, data_dir=str(tmp_path / "data"), verbose=False)
    assert p.read("dev") == dev and p.read("test") == test
    assert p.counts["pairs_read"] == 600 and p.counts["train"] + sum(p.counts["removed"].values()) == 600
    assert p.held_out["test"].endswith("mytest.en / " + str(tmp_path / "mytest.es"))
    plain = prepare(src=str(toy_files / "train.en"), tgt=str(toy_files / "train.es"), src_lang="en",
                    tgt_lang="es", vocab_size=320, data_dir=str(tmp_path / "data"), verbose=False)
    assert plain.counts["test"] == 30 and plain.held_out["test"].startswith("a seeded random slice")


def test_train_scores_the_given_test_set_and_names_it(toy_files, tmp_path):
    write_pair(tmp_path, "mydev", 12, seed=11)
    test_src, _ = write_pair(tmp_path, "mytest", 9, seed=12)
    r = run_train(toy_files, tmp_path / "data", tmp_path / "run", "--max-steps", "4", "--max-tokens", "400",
                  "--eval-every", "4", *own_sets(tmp_path))
    m = metrics(tmp_path / "run")
    # the end of the run says where everything went, the scores with their signature, what to run next
    end = r.stdout[r.stdout.index("done (max_steps at step 4"):]
    assert f"checkpoints: {tmp_path / 'run' / 'best.pt'} (best dev BLEU {m['best_dev_bleu']:.2f})" in end
    assert f"test BLEU {m['test_bleu']:.2f}" in end and f"test set: {tmp_path / 'mytest.en'}" in end
    assert f"sacreBLEU: {m['test_bleu_signature']}" in end and "nrefs:1|" in end
    assert f"python -m student.export {tmp_path / 'run' / 'best.pt'} {tmp_path / 'run' / 'model'}" in end
    assert m["test_set"] == f"{tmp_path / 'mytest.en'} / {tmp_path / 'mytest.es'}"
    assert m["dev_set"].startswith(str(tmp_path / "mydev.en"))
    assert len((tmp_path / "run" / "test.hyp").read_text().split("\n")[:-1]) == len(test_src)


@pytest.mark.parametrize("command", ["student.train", "student.distill"])
def test_a_dev_source_without_its_references_is_one_error_line(tmp_path, command):
    where = ["--out", str(tmp_path / "o")] if command == "student.train" else ["--runs-dir", str(tmp_path)]
    r = subprocess.run([sys.executable, "-m", command, *where, "--dev-src", str(tmp_path / "x.en")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and err[0].startswith("error:") and "--dev-tgt" in err[0], err


def test_distill_report_scores_and_names_the_given_test_set(env):  # noqa: F811
    write_pair(env, "mydev", 12, seed=11)
    test_src, _ = write_pair(env, "mytest", 9, seed=12)
    distill(env, "own", "--teacher-cmd", teacher_cmd(env), "--shard-size", "100", "--student-steps", "5",
            "--shortlist-k", "0", *own_sets(env))
    rep = json.load(open(env / "runs" / "own" / "report.json"))
    assert rep["test"]["sentences"] == len(test_src)
    assert rep["test"]["set"] == f"{env / 'mytest.en'} / {env / 'mytest.es'}"
    assert f"from {env / 'mytest.en'}" in (env / "runs" / "own" / "report.md").read_text()
    hyps = (env / "runs" / "own").glob("report-*/test.teacher.hyp")
    assert [len(h.read_text().split("\n")[:-1]) for h in hyps] == [len(test_src)]


def test_verdict_on_a_student_that_failed_to_learn_says_so_and_claims_no_aim():
    """A student at 0.00 next to a teacher at 0.28 was 'within the 0.5 aim'."""
    from student.distill.report import verdict
    v = verdict([{"system": "teacher", "bleu": 0.28}, {"system": "student", "bleu": 0.0},
                 {"system": "baseline", "bleu": 5.0}], {})
    text = " ".join(v)
    assert "within" not in text and "helps" not in text
    assert v[0].startswith("teacher failed to learn: test BLEU 0.28") and v[1].startswith("student failed to learn")
    assert v[2] == "KD student vs teacher: -0.28 BLEU (no verdict: student and teacher failed to learn)."
    assert v[3] == "KD student vs the same student without KD: -5.00 BLEU (no verdict: student failed to learn)."
    ok = verdict([{"system": "teacher", "bleu": 10.0}, {"system": "student", "bleu": 9.6}], {})
    assert ok == ["KD student vs teacher: -0.40 BLEU (within the 1.0 target and the 0.5 stretch)."]
