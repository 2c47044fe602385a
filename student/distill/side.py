"""The KD student and the baseline trained at the same time, each pinned to its own cores.

At student sizes one matrix product cannot keep several threads busy: measured on
2 cores (docs/distill.md), two runs as pinned one-thread processes do 1.5-1.6x the
work of one 2-thread run at a time. Each child runs student.train's train() on its
stage's exact TrainConfig in its stage's dir, so it resumes from its own last.pt,
and its weights are those a sequential run at the same thread count would give.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import re
import signal
import traceback
from multiprocessing.connection import wait

import torch

from student.train import TrainConfig, train


class StudentTrainingError(RuntimeError):
    """A student trained beside the other failed; the message names its stage."""


def split_cores(enabled: bool, pending: int, on_gpu: bool, world: int, torchrun: bool,
                cores: set[int]) -> tuple[list[list[int]], str | None]:
    """(one core list per student, None), or ([], why the students train one after the other)."""
    why = ("--no-side-by-side" if not enabled else
           "fewer than two students left to train" if pending < 2 else
           "a GPU trains them" if on_gpu else
           "torchrun ranks (NPROC>1) train them" if world > 1 or torchrun else
           "one core" if len(cores) < 2 else None)
    if why:
        return [], why
    c = sorted(cores)
    half = (len(c) + 1) // 2  # an odd core to the KD student, the run's headline
    return [c[:half], c[half:]], None


def train_side_by_side(runs: list[tuple[str, TrainConfig, str]], shares: list[list[int]], log) -> dict:
    """Train each (stage name, config, log file) in its own process on its share of cores;
    returns {name: {"cores", "threads", "pid"}} as each child saw them. A failing child
    stops the others and raises StudentTrainingError naming its stage."""
    ctx = mp.get_context("spawn")
    procs = {}
    try:
        for (name, tc, log_path), cores in zip(runs, shares):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(name, tc, log_path, os.getpid(), send), name=f"train-{name}")
            with _pinned(cores):  # the child inherits the mask: every thread it ever starts is pinned
                p.start()
            send.close()
            procs[name] = (p, recv, _Tail(log_path))
        log(" and ".join(f"[{n}] cores {c}" for n, c in zip(procs, shares)) + ": training side by side; logs: "
            + ", ".join(log_path for _, _, log_path in runs))
        return _wait(procs, log)
    finally:
        for p, _, _ in procs.values():
            if p.is_alive():
                p.terminate()
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _wait(procs: dict, log) -> dict:
    results = {}
    while len(results) < len(procs):
        wait([p.sentinel for n, (p, _, _) in procs.items() if n not in results], timeout=2)
        for name, (p, recv, tail) in procs.items():
            for line in tail.lines():
                log(f"[{name}] {line}")
            if name in results or p.exitcode is None:
                continue
            msg = recv.recv() if recv.poll() else {}
            if p.exitcode == 0 and "cores" in msg:
                results[name] = msg
                continue
            others = [n for n in procs if n != name and n not in results]
            raise StudentTrainingError(f"[{name}] training failed: {_why(p.exitcode, msg)} (log: {tail.path})"
                                       + (f"; stopped {' and '.join(others)} beside it" if others else ""))
    return results


def _why(code: int, msg: dict) -> str:
    if "error" in msg:
        return msg["error"]
    if code < 0:
        sig = signal.Signals(-code).name
        return f"its process was ended by {sig}" + (" (out of memory?)" if sig == "SIGKILL" else "")
    return f"its process exited with status {code}"


@contextlib.contextmanager
def _pinned(cores):
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def _child(name: str, tc: TrainConfig, log_path: str, parent: int, conn):
    _die_with_parent(parent)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # two progress bars on one terminal garble each other: each child its own log
    os.dup2(fd, 2)
    cores = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cores))
    print(f"pinned to cores {cores}, {len(cores)} torch thread(s), pid {os.getpid()}", flush=True)
    try:
        train(tc)
    except BaseException as e:  # noqa: BLE001 -- the parent reports it, naming the stage
        traceback.print_exc()
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1)
    conn.send({"cores": _thread_cores(), "threads": torch.get_num_threads(), "pid": os.getpid()})


def _thread_cores() -> list[int]:
    """The cores any of this process's threads (torch's pool included) may run on."""
    cores = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            cores |= os.sched_getaffinity(int(tid))
    return sorted(cores)


def _die_with_parent(parent: int):
    """A parent killed outright (SIGKILL) takes its training children with it (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


class _Tail:
    """A child's log lines that say where it stands (resume, dev evaluations), for the parent's log."""
    KEEP = ("step ", "resuming", "initialised", "removed ", "pinned")

    def __init__(self, path: str):
        self.path, self.rest = path, ""
        self.pos = os.path.getsize(path) if os.path.exists(path) else 0  # earlier runs' lines are old news

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        *done, self.rest = re.split(r"[\r\n]", self.rest + data.decode(errors="replace"))
        return [x for x in done if x.startswith(self.KEEP)]
