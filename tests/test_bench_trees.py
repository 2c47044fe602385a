"""tools/bench_trees.py: one checkout's decoder against another's, each in its own process."""
import os

from conftest import ROOT
from tools import bench_trees

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny")


def test_a_tree_against_itself_gives_identical_outputs_in_every_group(tmp_path, capsys):
    old = tmp_path / "old"  # a checkout from before tools/bench_trees.py: its decoder alone
    old.mkdir()
    (old / "decoder").symlink_to(os.path.join(ROOT, "decoder"))
    assert bench_trees.main(["--before", str(old), "--after", ROOT, "--model", os.path.join(FIXTURE, "model"),
                             "--src", os.path.join(FIXTURE, "test.en"), "--rounds", "2", "--passes", "1",
                             "--lines", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("round ") == 4  # two rounds, each tree once a round
    groups = __import__("json").loads(out[out.index("{\n"):])["groups"]
    assert set(groups) == {"throughput", "beam4", "batch1"}
    assert all(g["same_outputs"] and g["before"] > 0 and g["after"] > 0 and g["ratio"] > 0 for g in groups.values())


def test_a_directory_that_is_not_a_checkout_is_one_error_line(tmp_path, capsys):
    assert bench_trees.main(["--before", str(tmp_path), "--after", ROOT, "--model", "m", "--src", "s"]) == 2
    assert capsys.readouterr().err == f"error: --before {tmp_path}: not a checkout of the kit (no decoder/)\n"
