"""Pinned single-thread worker processes: CPU-ALL as one model copy per core.

At student sizes one matrix product is too small to keep several intra-op
threads busy, and the threads wait for one another at every op; independent
batches on pinned cores do not wait (docs/container.md: 1.2-1.4x on 2 cores).
The parent reads the input and forms the batches exactly as one process
would; the workers run the translator's methods the parent names on parts it
hands them: `ids` on a share of a chunk's lines (Moses and SentencePiece in
parallel, not in the parent while every worker waits), `translate_text` on
whole batches (their detokenisation too). A batch's output therefore does not
depend on how many workers there are, and the result equals a one-process run
with one thread.

A worker can die under the parent (the kernel's OOM killer picks the largest
process, and each worker holds a model copy). The pool then starts again with
one worker fewer and resubmits every batch that had not come back; with no
worker left the parent translates in its own process. Either way no batch is
lost and the output is unchanged, since a batch's output does not depend on
where it runs. This module does not import the translator: the pool is given
a picklable factory that builds a one-process, one-thread translator.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from functools import partial
from concurrent.futures import BrokenExecutor, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Callable

_translator = None  # this worker's own translator


def _init(factory: Callable, cores) -> None:
    core = cores.get()
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:  # out of memory, the kernel kills a worker (the parent recovers from that), not the parent
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("500")  # raising one's own score needs no privilege
    except OSError:
        pass
    global _translator
    _translator = factory()


def _call(method: str, arg, translator=None):
    """translator.method(arg); by default this worker's translator."""
    return getattr(translator or _translator, method)(arg)


class Job:
    """One call handed to the pool; `result()` waits for it wherever it ends up running."""

    def __init__(self, pool: WorkerPool, method: str, arg):
        self.pool, self.method, self.arg = pool, method, arg
        # (future, pool generation it belongs to): one attribute, so it is replaced
        # atomically when a dead worker's pool is rebuilt
        self.sent: tuple[Future, int] | None = None

    def result(self):
        while True:
            fut, gen = self.sent
            try:
                out = fut.result()
            except BrokenExecutor:
                self.pool._recover(gen)
                continue
            self.pool._forget(self)
            return out


class WorkerPool:
    """`n` processes, each pinned to one core of this process's affinity mask
    when there are at least `n` of them (else the scheduler places them).

    `factory()` builds the translator a worker runs (and the parent, once no
    worker is left); it must be picklable, e.g. a functools.partial of a class."""

    def __init__(self, factory: Callable, n: int):
        self._factory = factory
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}  # submitted, not yet collected: resubmitted after a death
        self._gen = 0
        self._local = None  # the parent's own translator, once no worker is left
        self.n = n
        self._executor = self._start(n)

    def _start(self, n: int) -> Executor:
        if n == 0:  # no process left: this one translates, one batch at a time
            self._local = self._factory()
            return ThreadPoolExecutor(1, thread_name_prefix="translate")
        # spawn, not fork: a forked child inherits torch's OpenMP pool in a broken state
        ctx = mp.get_context("spawn")
        cores = sorted(os.sched_getaffinity(0))
        queue = ctx.Queue()
        for i in range(n):
            queue.put(cores[i] if len(cores) >= n else None)
        ex = ProcessPoolExecutor(n, mp_context=ctx, initializer=_init, initargs=(self._factory, queue))
        for _ in range(n):  # start (and load) every worker now, while the parent reads its input
            ex.submit(int)
        return ex

    def wait_started(self, timeout: float = 300.0) -> None:
        """Returns once every worker has loaded its translator (ran a task), so that timing
        a translation does not time the workers' start-up."""
        if self._local is not None:
            return
        seen, end = set(), time.monotonic() + timeout
        while len(seen) < self.n and time.monotonic() < end:
            # a task runs only after its process's initializer: n distinct pids = n loaded workers
            try:
                seen.update(f.result() for f in [self._executor.submit(os.getpid) for _ in range(self.n)])
            except BrokenExecutor:  # a worker died starting: the first job's result() recovers
                return
            if len(seen) < self.n:
                time.sleep(0.05)

    def pids(self) -> list[int]:
        """The worker processes' ids (none once the parent translates itself)."""
        procs = getattr(self._executor, "_processes", None) or {}
        return sorted(procs)

    def submit(self, arg, method: str = "translate_ids") -> Job:
        """`translator.method(arg)` in a worker (in this process once none is left)."""
        job = Job(self, method, arg)
        with self._lock:
            self._jobs[id(job)] = job
            self._send(job)
        return job

    def _send(self, job: Job) -> None:
        """Queue `job` on the current executor (lock held)."""
        fn = _call if self._local is None else partial(_call, translator=self._local)
        try:
            fut = self._executor.submit(fn, job.method, job.arg)
        except BrokenExecutor as e:  # died before this submit: the job's result() recovers
            fut = Future()
            fut.set_exception(e)
        job.sent = (fut, self._gen)

    def _recover(self, gen: int) -> None:
        """A worker of generation `gen` died: one worker fewer, every pending job again."""
        with self._lock:
            if gen != self._gen:  # another job's result() already did it
                return
            old, self.n = self._executor, self.n - 1
            where = f"{self.n} worker process{'es' if self.n > 1 else ''}" if self.n else "this process"
            print(f"warning: a translation worker process died (out of memory?); "
                  f"finishing the input with {where}", file=sys.stderr, flush=True)
            old.shutdown(wait=False, cancel_futures=True)
            self._gen += 1
            self._executor = self._start(self.n)
            for job in self._jobs.values():
                if not _succeeded(job.sent[0]):
                    self._send(job)

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(id(job), None)

    def close(self) -> None:
        with self._lock:
            self._jobs.clear()
            self._executor.shutdown(wait=True, cancel_futures=True)


def _succeeded(fut: Future) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None
