"""The CPU-ALL worker count from the container's cgroup files (faked here):
cores from the CPU quota, and no more workers than the memory limit holds."""
import os

import pytest

from decoder import cgroup

MiB = 2**20
MODEL = 5 * MiB  # about the bible-tiny model dir


def fake(tmp_path, files: dict) -> str:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")
    return str(tmp_path)


def meminfo(tmp_path, kib: int) -> str:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       {kib} kB\nMemFree:        1 kB\n")
    return str(p)


@pytest.mark.parametrize("files, want", [
    ({"cpu.max": "200000 100000"}, 2.0),                                          # v2
    ({"cpu.max": "max 100000"}, None),
    ({"cpu.max": "150000 100000"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"}, 1.0),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ({}, None),
])
def test_cpu_quota_from_v1_and_v2_files(tmp_path, files, want):
    assert cgroup.cpu_quota(fake(tmp_path, files)) == want


@pytest.mark.parametrize("files, want", [
    ({"memory.max": str(512 * MiB)}, 512 * MiB),                                  # v2
    ({"memory.max": "max"}, 8 * 2**30),                                           # no limit: the machine's
    ({"memory/memory.limit_in_bytes": str(2 * 2**30)}, 2 * 2**30),                # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712"}, 8 * 2**30),         # v1 "no limit"
    ({}, 8 * 2**30),
])
def test_memory_limit_from_v1_and_v2_files(tmp_path, files, want):
    assert cgroup.memory_limit(fake(tmp_path, files), meminfo(tmp_path, 8 * 2**20)) == want


def test_quota_caps_cores_rounding_up(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cgroup.usable_cores(fake(tmp_path / "a", {"cpu.max": "150000 100000"})) == 2
    assert cgroup.usable_cores(fake(tmp_path / "b", {"cpu.max": "max 100000"})) == 16
    assert cgroup.usable_cores(fake(tmp_path / "c", {"cpu.max": "5000 100000"})) == 1


@pytest.mark.parametrize("limit, cores, want", [
    (512 * MiB, 2, 0),    # --memory 512m --cpus 2: two workers were OOM-killed; one process instead
    (768 * MiB, 2, 0),    # the parent and two workers peaked at 724 MiB: too close
    (1024 * MiB, 2, 2),
    (2048 * MiB, 2, 2),   # the task's setting: a worker per core
    (2048 * MiB, 16, 6),  # memory, not cores, is the bound
    (None, 4, 4),
    (64 * 2**30, 1, 0),   # one core: nothing to spread
])
def test_worker_count_is_bounded_by_cores_and_memory(limit, cores, want):
    assert cgroup.workers_that_fit(cores, limit, MODEL) == want


def test_bigger_model_fits_fewer_workers():
    assert cgroup.workers_that_fit(8, 4 * 2**30, 5 * MiB) == 8
    assert cgroup.workers_that_fit(8, 4 * 2**30, 500 * MiB) == 3


def test_serve_settings_read_the_memory_limit(tmp_path, monkeypatch):
    from submission.container import serve
    monkeypatch.setattr(cgroup, "ROOT", fake(tmp_path / "cg", {"cpu.max": "200000 100000",
                                                               "memory.max": str(512 * MiB)}))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * MODEL)
    s = serve.settings("CPU-ALL", str(model))
    assert (s["threads"], s["workers"]) == (2, 0)
    monkeypatch.setattr(cgroup, "ROOT", fake(tmp_path / "cg2", {"cpu.max": "200000 100000",
                                                                "memory.max": str(2 * 2**30)}))
    s = serve.settings("CPU-ALL", str(model))
    assert (s["threads"], s["workers"]) == (2, 2)
    assert serve.settings("CPU-1", str(model))["workers"] == 0
