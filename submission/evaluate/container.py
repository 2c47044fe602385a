"""The submission image, measured through its WMT interface (/run.sh) with the docker SDK.

A container is a fresh process per run, so its load time cannot be read from outside a
throughput run: it is the median wall time of runs with empty input (start, imports,
model load, exit), and a run's translation time is its wall time minus that. In latency mode
one container answers line after line; its first answer (start + load + one sentence)
is the load time. Peak memory is the container cgroup's own high-water mark, printed
by a wrapper around /run.sh after it exits.
"""
from __future__ import annotations

import io
import os
import statistics
import tarfile
import time

from submission.image import client as image_client
from submission.dockerrun import Session, run

from .systems import EvalError, System

MARK = "evaluate: memory peak "
WRAP = ('/run.sh "$1" "$2"; rc=$?; '
        'for f in /sys/fs/cgroup/memory.peak /sys/fs/cgroup/memory/memory.max_usage_in_bytes; do '
        f'if [ -r "$f" ]; then echo "{MARK}$(cat "$f")" >&2; break; fi; done; exit $rc')


def command(hardware: str, task: str) -> list[str]:
    return ["sh", "-c", WRAP, "sh", hardware, task]


def split_stderr(stderr: bytes) -> tuple[int | None, str]:
    """(cgroup peak bytes or None, the container's own stderr)."""
    peak, rest = None, []
    for line in stderr.decode("utf-8", errors="replace").splitlines():
        if line.startswith(MARK) and line[len(MARK):].strip().isdigit():
            peak = int(line[len(MARK):])
        else:
            rest.append(line)
    return peak, "\n".join(rest)


def client():
    try:
        return image_client()
    except SystemExit as e:  # image_client() is the CLI's: it exits with one error line
        raise EvalError(str(e).removeprefix("error: ")) from None


def image_facts(image: str, out_dir: str) -> dict:
    """Image size, and its /model copied out (size on disk, spm.model for token counts)."""
    import docker
    c = client()
    try:
        im = c.images.get(image)
    except docker.errors.ImageNotFound:
        raise EvalError(f"no docker image {image!r} (make image, or --container build)") from None
    ctr = c.containers.create(image, command=["true"])
    try:
        stream, _ = ctr.get_archive("/model")
        buf = io.BytesIO(b"".join(stream))
    finally:
        ctr.remove(force=True)
    with tarfile.open(fileobj=buf) as tar:
        tar.extractall(out_dir, filter="data")
    model = os.path.join(out_dir, "model")
    return {"image_bytes": im.attrs["Size"], "image_id": im.id, "model_dir": model,
            "model_bytes": sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model))}


def _limits(system: System, mem_limit: str) -> dict:
    kw = dict(nano_cpus=int(system.cpus * 1e9), mem_limit=mem_limit, memswap_limit=mem_limit)
    if system.hardware == "GPU":
        import docker
        kw["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return kw


def _run(system: System, stdin: bytes, mem_limit: str) -> tuple[float, list[str], int | None]:
    t = time.perf_counter()
    r = run(system.image, command(system.hardware, "throughput"), stdin, **_limits(system, mem_limit))
    wall = time.perf_counter() - t
    peak, err = split_stderr(r.stderr)
    if r.exit_code or r.oom_killed:
        why = "killed for memory" if r.oom_killed else f"exit status {r.exit_code}"
        raise EvalError(f"container {system.label}: {why}: {(err.strip().splitlines() or ['?'])[-1][:200]}")
    out = r.stdout.decode("utf-8", errors="replace").split("\n")
    return wall, out[:-1] if out and out[-1] == "" else out, peak


def _encode(lines: list[str]) -> bytes:
    return "".join(x + "\n" for x in lines).encode("utf-8", errors="replace")


def measure(system: System, lines: list[str], repeats: int, warmup_lines: int, mem_limit: str = "2g") -> dict:
    client()  # one clear line when there is no daemon
    if system.mode == "latency":
        return _measure_latency(system, lines, repeats, warmup_lines, mem_limit)
    warm = lines[:max(1, warmup_lines)]
    wall, _, _ = _run(system, _encode(warm), mem_limit)
    res = {"warmup": {"seconds": wall, "lines": len(warm), "note": "first container run: cold start + load"}}
    # an empty-input run before each timed one: container start-up is the noisiest part
    loads, peaks = [], []
    for _ in range(repeats):
        wall, _, peak = _run(system, b"", mem_limit)
        loads.append(wall)
        peaks.append(peak)
    load_s = statistics.median(loads)
    res.update(load_s=load_s, load_runs_s=loads)
    runs, outputs = [], []
    for _ in range(repeats):
        wall, hyps, peak = _run(system, _encode(lines), mem_limit)
        if len(hyps) != len(lines):
            raise EvalError(f"container {system.label}: {len(hyps)} output lines for {len(lines)} input lines")
        runs.append({"seconds": max(wall - load_s, 1e-9), "wall_s": wall})
        outputs.append(hyps)
        peaks.append(peak)
    known = [p for p in peaks if p is not None]
    res.update(runs=runs, hyps=outputs[-1], identical_repeats=all(o == outputs[0] for o in outputs),
               peak_mem_mb=max(known) / 2**20 if known else None, peak_mem_source="cgroup")
    return res


def _measure_latency(system: System, lines, repeats, warmup_lines, mem_limit) -> dict:
    t0 = time.perf_counter()
    s = Session(system.image, command(system.hardware, "latency"), **_limits(system, mem_limit))
    try:
        def ask(line: str, since: float | None = None) -> tuple[str, float]:
            t = since or time.perf_counter()
            s.write(_encode([line]))
            ans = s.read_until(1, timeout=300)
            if not ans.endswith(b"\n"):
                raise EvalError(f"container {system.label} stopped answering; stderr: "
                                f"{bytes(s._err)[-200:].decode(errors='replace')}")
            return ans[:-1].decode("utf-8", errors="replace"), time.perf_counter() - t
        res = {"load_s": ask(lines[0], t0)[1]}  # start + model load + the first sentence
        warm = lines[1:max(1, warmup_lines)]
        res["warmup"] = {"seconds": sum(ask(x)[1] for x in warm), "lines": len(warm)}
        runs, outputs = [], []
        for _ in range(repeats):
            answers = [ask(x) for x in lines]
            runs.append({"seconds": sum(a[1] for a in answers), "latencies_s": [a[1] for a in answers]})
            outputs.append([a[0] for a in answers])
        s.close_stdin()
        r = s.wait(timeout=300)
    finally:
        s.remove()
    peak, err = split_stderr(r.stderr)
    if r.exit_code:
        raise EvalError(f"container {system.label}: exit status {r.exit_code}: {err[-200:]}")
    res.update(runs=runs, hyps=outputs[-1], identical_repeats=all(o == outputs[0] for o in outputs),
               peak_mem_mb=peak / 2**20 if peak else None, peak_mem_source="cgroup")
    return res
