"""The data benchmark (`python -m student.data.bench`) runs end to end on a tiny corpus: a
benchmark nobody runs in CI breaks silently (its train phase once lost the batch sizes)."""
import json

from student.data import bench
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
