"""`python -m decoder --workers N` starts no more worker processes than the usable cores (affinity
mask and CPU quota) and the memory limit hold, and says so in one warning line. Before: `--workers
64` on 2 cores started 64 processes holding 19.2 GB."""
import os

import pytest

from decoder.workers import usable_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")
MiB, GiB = 2**20, 2**30


def cgroup_root(tmp_path, cpu_max: str = "max 100000", memory_max: str = "max") -> str:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    (tmp_path / "memory.max").write_text(memory_max + "\n")
    return str(tmp_path)


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))


def test_workers_above_the_cpu_quota_are_lowered_to_the_usable_cores_with_one_warning(tmp_path, eight_cores):
    root = cgroup_root(tmp_path, cpu_max="200000 100000", memory_max=str(64 * GiB))
    assert usable_workers(64, 5 * MiB, root) == (
        2, "warning: --workers 64 lowered to 2: 2 usable cores (affinity and CPU quota)")


def test_workers_above_the_affinity_mask_are_lowered_to_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    root = cgroup_root(tmp_path, memory_max=str(64 * GiB))
    assert usable_workers(4, 5 * MiB, root) == (
        0, "warning: --workers 4 lowered to one process: 1 usable core (affinity and CPU quota)")


@pytest.mark.parametrize("limit, want", [
    # 0.9 of the limit, less the parent (300 MiB) and the model once, over 225 MiB + the model a worker
    (2 * GiB, (3, "warning: --workers 8 lowered to 3: the memory limit, 2.0 GiB, holds 3 worker processes "
                  "of this 170 MiB model")),
    (1 * GiB, (0, "warning: --workers 8 lowered to one process: the memory limit, 1.0 GiB, holds fewer than 2 "
                  "worker processes of this 170 MiB model")),
])
def test_workers_beyond_what_memory_holds_are_lowered_with_one_warning(tmp_path, eight_cores, limit, want):
    assert usable_workers(8, 170 * MiB, cgroup_root(tmp_path, memory_max=str(limit))) == want


def test_workers_the_machine_holds_and_one_process_are_kept_without_a_warning(tmp_path, eight_cores):
    root = cgroup_root(tmp_path, memory_max=str(64 * GiB))
    assert usable_workers(8, 5 * MiB, root) == (8, None)
    assert usable_workers(1, 5 * MiB, root) == (1, None) and usable_workers(0, 5 * MiB, root) == (0, None)


def test_cli_workers_beyond_the_cores_run_as_the_cores_allow_and_warn_once(tmp_path, monkeypatch, capsys):
    from decoder.__main__ import main
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    src = tmp_path / "in.txt"
    src.write_text("in the beginning\nand god said\nlet there be light\n")
    assert main(["--model", FIXTURE, "--workers", "64", "-i", str(src), "-o", str(tmp_path / "out.txt")]) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert warnings == ["warning: --workers 64 lowered to one process: 1 usable core (affinity and CPU quota)"]
    assert len((tmp_path / "out.txt").read_text().splitlines()) == 3
