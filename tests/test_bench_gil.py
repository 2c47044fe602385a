"""tools/bench_gil.py: the GPU-feeding loop's busy share, alone and beside the text encoding,
at each switch interval; Python's own interval left as it was."""
import json
import os
import sys

import pytest

from tools import bench_gil

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
MODEL, SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")
trained = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "config.json")),
                             reason="trained fixture tests/fixtures/bible-tiny is absent")


def test_the_feeder_is_busy_for_its_blocks_share_of_the_wall():
    busy = bench_gil.feeder(0.002, 0.02)
    assert 0.2 < busy <= 1.0  # ten 2 ms sleeps: most of the wall, never more than all of it


@trained
def test_rows_alone_and_beside_the_encoding_at_each_interval(tmp_path, capsys):
    before = sys.getswitchinterval()
    out = str(tmp_path / "gil")
    assert bench_gil.main(["--model", MODEL, "--src", SRC, "--lines", "20", "--seconds", "0.02",
                           "--block-ms", "1", "--intervals", "5", "0.2", "--out", out]) == 0
    rows = json.load(open(out + ".json"))["rows"]
    assert [(r["beside"], r["interval_ms"]) for r in rows] == [("nothing", before * 1e3), ("Text.encode", 5),
                                                               ("Text.encode", 0.2)]
    assert all(0 < r["busy"] <= 1 for r in rows) and all(r["encode_lines_per_s"] > 0 for r in rows[1:])
    assert sys.getswitchinterval() == before
    reads = json.load(open(out + ".json"))["read_outputs"]
    assert set(reads) == {"rows", "T", "tolist_ms", "tolist_and_scan_ms", "until_ms"}
    md = open(out + ".md").read()
    assert md.startswith("Machine: ") and md.count("| Text.encode |") == 2 and md in capsys.readouterr().out
