"""What a process may use: cores (affinity mask and CPU quota) and memory
(the cgroup limit, else the machine's), read from cgroup v2 or v1 files, and the
worker count they allow: the container's CPU-ALL count, and the bound on
`python -m decoder --workers` (workers.usable_workers).

`docker run --cpus N --memory M` sets only the cgroup's quota and limit;
nproc, torch's default thread count and /proc/meminfo still show the host.
A worker count chosen from cores alone got the workers OOM-killed under
`--memory 512m --cpus 2`, so the count is the smaller of the cores and the
workers whose model copies fit in the limit.

Memory per process, measured in the image with the bible-tiny model (4.3 MiB
of weights; cgroup v1 peak, 20,000 lines, --cpus 2): one process translating
in-process 245 MiB; the parent plus 2 workers 623 MiB, plus 3 workers 839 MiB,
so one worker is 216 MiB and the parent without a model about 190 MiB
(`/run.sh CPU-ALL throughput`, which also measures int8 at start: 724 MiB).
With a 170 MiB model each worker grew by about its weights (the weights are
mapped from the file, whose pages the cgroup charges once, and copied where
the model fuses or quantises them). Hence the estimate below: a parent of
300 MiB, the model file once, and per worker 225 MiB plus the model's size,
within 90% of the limit (chunks of long lines and the batches' activations
come on top).
"""
from __future__ import annotations

import math
import os

ROOT = "/sys/fs/cgroup"
MiB = 2**20
PARENT_BYTES = 300 * MiB  # reader, text pipeline, int8 check; no model
WORKER_BYTES = 225 * MiB  # torch + SentencePiece + buffers of one 1-thread process, without its weights
USABLE = 0.9              # of the limit: the rest is headroom for chunks and activations
UNLIMITED = 2**62         # cgroup v1 writes "no limit" as about 2**63


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def cpu_quota(root: str | None = None) -> float | None:
    """Cores' worth of CPU time the quota allows (None: no quota)."""
    root = root or ROOT
    v2 = _read(os.path.join(root, "cpu.max"))
    if v2 is not None:
        q, _, p = v2.partition(" ")
        try:
            return None if q == "max" else int(q) / int(p or 100000)
        except ValueError:
            return None
    q, p = _read(os.path.join(root, "cpu", "cpu.cfs_quota_us")), _read(os.path.join(root, "cpu", "cpu.cfs_period_us"))
    try:
        return int(q) / int(p) if int(q) > 0 else None
    except (TypeError, ValueError):
        return None


def memory_limit(root: str | None = None, meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes this container may use: the cgroup limit, else the machine's memory (None: unknown)."""
    root = root or ROOT
    for f in ("memory.max", os.path.join("memory", "memory.limit_in_bytes")):
        v = _read(os.path.join(root, f))
        if v is not None and v.isdigit() and int(v) < UNLIMITED:
            return int(v)
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def usable_cores(root: str | None = None) -> int:
    """The affinity mask, capped by the CFS quota (rounded up: 1.5 CPUs keep 2 cores busy)."""
    n = len(os.sched_getaffinity(0))
    quota = cpu_quota(root)
    return max(1, min(n, math.ceil(quota))) if quota else n


def workers_that_fit(cores: int, limit: int | None, model_bytes: int) -> int:
    """CPU-ALL worker processes: one per core while their model copies fit in
    `limit`; 0 (one process with a thread per core, one model copy) when fewer
    than 2 would fit."""
    n = cores
    if limit is not None:
        n = min(n, int((limit * USABLE - PARENT_BYTES - model_bytes) // (WORKER_BYTES + model_bytes)))
    return n if n >= 2 else 0


def model_bytes(model_dir: str) -> int:
    """Size of the model dir's files (weights, vocabulary, shortlist)."""
    try:
        return sum(e.stat().st_size for e in os.scandir(model_dir) if e.is_file())
    except OSError:
        return 0  # a missing dir is reported by the model loader, with its own error line
