"""Every command that writes, with its k-th write, fsync, rename or file creation failing
(ENOSPC, EROFS, EACCES, EIO; tests/faults.py): one `error:` line, a non-zero status, no
partial output, and what was there before intact. The writers' counterpart of the options'
Hypothesis suite (tests/test_option_properties.py)."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import sys

import pytest
import torch

from tests.faults import build_shim, error_lines, run_cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIBLE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny")
ARGS = dict(vocab_size=64, d_model=32, n_heads=4, ffn_dim=48, encoder_layers=1, decoder_layers=1, dropout=0.0)

# What each command meets: a full disk mid-file, a read-only mount at the last fsync, a
# permission refused at the publishing rename, an I/O error at the first file it creates.
FAULTS = [("write", "mid", errno.ENOSPC), ("fsync", "last", errno.EROFS),
          ("rename", "last", errno.EACCES), ("create", "first", errno.EIO)]


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    so = build_shim(str(tmp_path_factory.mktemp("shim")))
    if so is None:
        pytest.skip("no C compiler to build the fault-injection library")
    return so


def faulted(argv: list[str], other: list[str] | None = None, faults=FAULTS) -> list[dict]:
    """A count of argv's events (it runs once more, on what the first run left), then `other`
    with each fault, then `other` without one. `other` writes what argv does with other
    contents, so that a faulted run which replaced the output and still failed is caught."""
    other = other or argv
    return ([{"argv": argv}] + [{"argv": other, "kind": kind, "k": k, "errno": e} for kind, k, e in faults]
            + [{"argv": other}])


def assert_one_line_and_nothing_lost(results: list[dict], same: bool = True) -> None:
    """Each faulted case: the fault landed, one error line, non-zero status, no traceback;
    `same`: the tree under the output's dir is byte for byte what it was, and the last case
    (the same command, no fault) shows that the command changes it."""
    count, faults, last = results[0], results[1:-1], results[-1]
    assert count["code"] in (0, None), count["stderr"][-3000:]
    for r in faults:
        what = f"{r['case']['kind']} #{r['k']} ({errno.errorcode[r['case']['errno']]})"
        assert r["injected"] == 1, f"{what}: no such event (seen {r['seen']})"
        assert r["code"] not in (0, None, "traceback"), f"{what}: exit {r['code']}\n{r['stderr'][-3000:]}"
        assert "Traceback" not in r["stderr"], f"{what}:\n{r['stderr'][-3000:]}"
        assert len(error_lines(r["stderr"])) == 1, f"{what}:\n{r['stderr'][-3000:]}"
        assert not [n for n in r["after"] if ".tmp." in n], f"{what}: temp left: {sorted(r['after'])}"
        if same:
            assert r["after"] == r["before"], f"{what}: {sorted(set(r['after'].items()) ^ set(r['before'].items()))}"
        else:  # nothing that was there is gone
            assert set(r["before"]) <= set(r["after"]), f"{what}: lost {set(r['before']) - set(r['after'])}"
    assert last["code"] in (0, None), last["stderr"][-3000:]
    if same:
        assert last["after"] != last["before"], "the faulted command writes what was there: the test shows nothing"


def checkpoint(path, spm_model: str, seed: int = 0) -> str:
    from student.model import ModelArgs, Transformer
    torch.manual_seed(seed)
    m = Transformer(ModelArgs(**ARGS))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": m.state_dict(), "model_args": dataclasses.asdict(m.args), "step": 1,
                "meta": {"spm_model": spm_model, "src_lang": "en", "tgt_lang": "es"}}, path)
    return str(path)


def test_export_on_a_failing_disk_keeps_the_previous_model_dir(shim, tmp_path, tiny_spm):
    ckpt = checkpoint(tmp_path / "run" / "best.pt", tiny_spm)
    other = checkpoint(tmp_path / "run" / "last.pt", tiny_spm, seed=1)
    out = tmp_path / "w" / "model"
    argv = ["student.export", ckpt, str(out)]
    results = run_cases(shim, str(tmp_path / "w"), [{"argv": argv}] + faulted(argv, [argv[0], other, str(out)]))
    assert sorted(results[0]["after"]) == ["model", "model/config.json", "model/model.safetensors",
                                           "model/spm.model"]
    assert_one_line_and_nothing_lost(results[1:])


def test_decoder_output_on_a_failing_disk_keeps_the_previous_file(shim, tmp_path):
    (tmp_path / "in.txt").write_text("in the beginning\nand the earth\n", encoding="utf-8")
    (tmp_path / "other.txt").write_text("and god said\nlet there be light\n", encoding="utf-8")
    out = tmp_path / "w" / "out.txt"
    out.parent.mkdir()
    out.write_text("previous\n")

    def argv(src):
        return ["decoder", "--model", os.path.join(BIBLE, "model"), "-i", str(tmp_path / src), "-o", str(out),
                "--threads", "1", "--quiet"]
    results = run_cases(shim, str(tmp_path / "w"), faulted(argv("in.txt"), argv("other.txt")))
    assert_one_line_and_nothing_lost(results)


def test_shortlist_on_a_failing_disk_keeps_the_model_dir_as_it_was(shim, tmp_path):
    model = tmp_path / "w" / "model"
    shutil.copytree(os.path.join(BIBLE, "model"), model)
    argv = ["student.shortlist", "--model", str(model), "--src", os.path.join(BIBLE, "test.en"),
            "--tgt", os.path.join(BIBLE, "test.es"), "--k", "5", "--frequent", "5"]
    results = run_cases(shim, str(tmp_path / "w"), [{"argv": argv}] + faulted(argv, argv[:-1] + ["6"]))
    assert "model/shortlist.safetensors" in results[0]["after"]
    assert_one_line_and_nothing_lost(results[1:])


def test_convert_on_a_failing_disk_keeps_the_previous_output(shim, tmp_path):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "w" / "ct2"
    argv = ["tools.convert", "--to", "ct2", os.path.join(BIBLE, "model"), str(out), "--force"]
    other = argv + ["--quantization", "int8"]
    results = run_cases(shim, str(tmp_path / "w"), [{"argv": argv}] + faulted(argv, other))
    assert "ct2/model.bin" in results[0]["after"]
    assert_one_line_and_nothing_lost(results[1:])


def test_convert_to_hf_on_a_failing_disk_keeps_the_previous_output(shim, tmp_path):
    pytest.importorskip("transformers")
    other = tmp_path / "other"  # the same model with other languages: other files, as many
    shutil.copytree(os.path.join(BIBLE, "model"), other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["languages"] = {"src": "xx", "tgt": "yy"}
    (other / "config.json").write_text(json.dumps(cfg))
    argv = ["tools.convert", "--to", "hf", os.path.join(BIBLE, "model"), str(tmp_path / "w" / "hf"), "--force"]
    other_argv = argv[:3] + [str(other)] + argv[4:]
    results = run_cases(shim, str(tmp_path / "w"), [{"argv": argv}] + faulted(argv, other_argv, FAULTS[:3]))
    assert "hf/model.safetensors" in results[0]["after"]
    assert_one_line_and_nothing_lost(results[1:])


def test_data_prepare_on_a_failing_disk_leaves_no_partial_cache(shim, tmp_path, toy_files):
    data = tmp_path / "w"

    def argv(seed):
        return ["student.data", "prepare", "toy", "--src", str(toy_files / "train.en"), "--tgt",
                str(toy_files / "train.es"), "--vocab-size", "300", "--data-dir", str(data), "--seed", str(seed), "-q"]
    cases = [{"argv": argv(1)}, {"argv": argv(2)}]
    cases += [{"argv": argv(3 + i), "kind": kind, "k": k, "errno": e} for i, (kind, k, e) in enumerate(FAULTS)]
    cases += [{"argv": argv(3)}]
    results = run_cases(shim, str(data), cases)
    assert_one_line_and_nothing_lost(results[1:])


def test_training_and_averaging_on_a_failing_disk_lose_no_checkpoint(shim, tmp_path, toy_files):
    """A resumed run whose save fails: the previous checkpoints stay, every file there loads."""
    run = tmp_path / "w" / "run"
    env = {**os.environ, "KIT_DATA_DIR": str(tmp_path / "data")}

    def train(steps):
        return ["student.train", "--out", str(run), "--preset", "student-tiny", "--src", str(toy_files / "train.en"),
                "--tgt", str(toy_files / "train.es"), "--vocab-size", "320", "--amp", "off", "--max-tokens", "300",
                "--set", "d_model=32", "--set", "n_heads=2", "--set", "ffn_dim=64", "--set", "encoder_layers=1",
                "--max-steps", str(steps), "--save-every", "2", "--eval-every", "0", "--no-test"]
    cases = [{"argv": train(2)}, {"argv": train(4)}]
    cases += [{"argv": train(6 + 2 * i), "kind": kind, "k": k, "errno": e} for i, (kind, k, e) in enumerate(FAULTS)]
    cases += [{"argv": train(14)}]
    avg = ["student.train", "average", "--run", str(run), "--last", "2", "--out", str(tmp_path / "w" / "avg.pt")]
    cases += faulted(avg, avg[:5] + ["3"] + avg[6:])
    results = run_cases(shim, str(tmp_path / "w"), cases, env=env)
    assert_one_line_and_nothing_lost(results[1:7], same=False)
    for name in os.listdir(run):
        if name.endswith(".pt"):
            torch.load(run / name, weights_only=True)  # complete, whichever version
    assert_one_line_and_nothing_lost(results[7:])


def test_distillation_on_a_failing_disk_keeps_every_finished_stage(shim, tmp_path):
    """Reruns of a finished run (they rewrite the manifest, the links, the report) and one
    whose student stage is new, each on a failing disk: every stage that was done stays done
    and whole, and a stage cut short has no done.json."""
    from tests.conftest import toy_parallel
    from tests.test_distill import TEACHER, TINY
    src, tgt = toy_parallel(240, seed=3)
    (tmp_path / "c.en").write_text("\n".join(src) + "\n", encoding="utf-8")
    (tmp_path / "c.es").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    (tmp_path / "teacher.py").write_text(TEACHER, encoding="utf-8")
    env = {**os.environ, "KIT_DATA_DIR": str(tmp_path / "data")}

    def distill(steps):
        return ["student.distill", "--runs-dir", str(tmp_path / "w"), "--name", "up", "--src", str(tmp_path / "c.en"),
                "--tgt", str(tmp_path / "c.es"), *TINY, "--teacher-cmd", f"{sys.executable} {tmp_path / 'teacher.py'}",
                "--shard-size", "50", "--student-steps", str(steps), "--shortlist-k", "0"]
    cases = [{"argv": distill(10)}] + faulted(distill(10))[:-1]
    cases += [{"argv": distill(12), "kind": "write", "k": 40, "errno": errno.ENOSPC}, {"argv": distill(10)}]
    results = run_cases(shim, str(tmp_path / "w"), cases, env=env)
    assert_one_line_and_nothing_lost(results[1:], same=False)
    done = [n for n in results[1]["after"] if n.endswith("done.json")]
    for r in results[2:-1]:
        assert [n for n in r["after"] if n.endswith("done.json")] == done  # none lost, none for a cut stage
        assert all(r["after"][n] == results[1]["after"][n] for n in done)
    json.load(open(tmp_path / "w" / "up" / "manifest.json"))  # whole, whichever version


def test_shape_model_on_a_failing_disk_keeps_the_previous_model_dir(shim, tmp_path):
    argv = ["student.shape_model", "--preset", "student-tiny", "--like", os.path.join(BIBLE, "model"),
            "--out", str(tmp_path / "w" / "shape")]
    results = run_cases(shim, str(tmp_path / "w"), [{"argv": argv}] + faulted(argv, argv + ["--seed", "1"]))
    assert "shape/model.safetensors" in results[0]["after"]
    assert_one_line_and_nothing_lost(results[1:])
