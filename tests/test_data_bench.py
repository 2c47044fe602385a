"""The data benchmark (`python -m student.data.bench`) runs end to end on a tiny corpus: a
benchmark nobody runs in CI breaks silently (its train phase once lost the batch sizes)."""
import json
import os

import pytest

from student.data import bench
from tools import synth_corpus
from tools.synth_corpus import generate


def test_data_bench_reports_every_phase_on_a_tiny_corpus(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))  # restored after: main() sets it
    src, tgt = generate(600, str(tmp_path / "synth"), "en", "de", seed=1, verbose=False)
    assert bench.main(["--src", src, "--tgt", tgt, "--work", str(tmp_path / "work"), "--vocab-size", "500"]) == 0
    out = json.loads(capsys.readouterr().out)
    prep, train = out["prepare"], out["encode_and_first_step"]
    assert prep["wall_s"] > 0 and prep["peak_tree_rss_gb"] > 0
    assert train["pairs"] == 540 and train["batches"] >= 1  # 600 less the 30-pair dev and test draws
    assert train["loss"] > 0 and train["peak_tree_rss_gb"] > 0
    assert out["machine"]["cpu"] and out["machine"]["date"]  # where and when it ran


def test_data_bench_builds_the_shortlist_of_the_prepared_train_split(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))
    src, tgt = generate(600, str(tmp_path / "synth"), "en", "de", seed=1, verbose=False)
    work = str(tmp_path / "work")
    assert bench.main(["--src", src, "--tgt", tgt, "--work", work, "--vocab-size", "500", "--shortlist"]) == 0
    short = json.loads(capsys.readouterr().out)["shortlist"]
    assert short["lines"] == 540 and short["source_tokens_with_list"] > 100 and short["peak_tree_rss_gb"] > 0
    assert os.path.isfile(short["path"]) and short["path"].startswith(work)


def test_data_bench_speedup_prepares_pinned_and_on_every_core_with_the_same_bytes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))
    src, tgt = generate(600, str(tmp_path / "synth"), "en", "de", seed=1, verbose=False)
    assert bench.main(["--src", src, "--tgt", tgt, "--work", str(tmp_path / "work"), "--vocab-size", "500",
                       "--speedup"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] and out["one_core"]["digest"] == out["all_cores"]["digest"]
    assert out["speedup"] > 0 and "encode_and_first_step" not in out


@pytest.mark.parametrize("args, says", [
    (["--src-lang", "de"], "--src-lang 'de' and --tgt-lang 'de': two distinct codes of 2-3 letters"),
    (["--tgt-lang", "../en"], "two distinct codes of 2-3 letters"),  # would write outside --out
    (["--out", "FILE"], "exists and is not a directory"),
])
def test_synth_corpus_refuses_what_would_not_make_two_files_in_a_folder(args, says, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    args = [str(tmp_path / "file") if x == "FILE" else x for x in args]
    with pytest.raises(SystemExit) as e:
        synth_corpus.main(["--pairs", "10", "--out", str(tmp_path / "synth"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "synth").exists()


def test_data_bench_failure_says_the_failed_phase_s_own_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))
    src, tgt = generate(300, str(tmp_path / "synth"), "en", "de", seed=1, verbose=False)
    with pytest.raises(SystemExit) as e:  # 300 pairs yield far fewer than 8,000 pieces
        bench.main(["--src", src, "--tgt", tgt, "--work", str(tmp_path / "work"), "--vocab-size", "8000"])
    said = str(e.value.code)
    assert said.startswith("error: SentencePiece training failed: --vocab-size 8,000") and "\n" not in said, said
    assert "bench.log" in said
