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

A pool that cannot start (no worker loads its translator: under `docker run
--pids-limit` a worker cannot start a thread) gives one warning and the parent
translates in its own process at once; it never waits for a worker that will
not come. A worker never outlives its parent: killed by SIGKILL, the parent
closes nothing, and a worker waiting on its call queue would wait forever
(every worker holds both ends of that pipe), holding its model copy. Each
worker watches the pipe that multiprocessing gives every spawned child, whose
write end only the parent holds: end of file there means the parent is gone,
and the worker exits. Linux's parent-death signal (PR_SET_PDEATHSIG) is not
used: it fires when the *thread* that started the child ends, and a pool is
restarted from whichever thread found a worker dead (the pipeline's reader
thread among them), which ends long before the parent.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from functools import partial
from concurrent.futures import BrokenExecutor, Executor, Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as WaitTimeout  # builtin TimeoutError from 3.11 only
from typing import Callable

from . import cgroup

_CHECK_S = 1.0  # a waiting job checks this often that its executor can still answer
_translator = None  # this worker's own translator
_start_error: str | None = None  # why it could not be built


def usable_workers(requested: int, model_bytes: int, root: str | None = None) -> tuple[int, str | None]:
    """(the worker processes to start for --workers `requested`, the warning line when that is fewer).

    A worker beyond the usable cores (the affinity mask, capped by the CPU quota) waits for a core
    and buys nothing; one beyond what memory holds (each holds torch and a model copy: the parent,
    the model once, and WORKER_BYTES plus the model a worker, within 90% of the cgroup limit or the
    machine's memory) gets the run OOM-killed: `--workers 64` on 2 cores started 64 processes
    holding 19.2 GB. The same bounds as the container's CPU-ALL (cgroup.workers_that_fit); fewer
    than 2 is one process (0)."""
    if requested <= 1:
        return requested, None
    cores, limit = cgroup.usable_cores(root), cgroup.memory_limit(root)
    by_memory = cgroup.workers_that_fit(requested, limit, model_bytes) or 1  # 1: fewer than 2 fit
    n = min(requested, cores, by_memory)
    if n == requested:
        return n, None
    why = (f"{cores} usable core{'s' * (cores != 1)} (affinity and CPU quota)" if cores <= by_memory else
           f"the memory limit, {limit / 2**30:.1f} GiB, holds {by_memory if by_memory > 1 else 'fewer than 2'} "
           f"worker processes of this {model_bytes / 2**20:.0f} MiB model")
    return (n if n > 1 else 0), f"warning: --workers {requested} lowered to {n if n > 1 else 'one process'}: {why}"


class WorkerStartError(Exception):
    """A worker process could not build its translator; every call to it raises this."""


def _init(factory: Callable, cores) -> None:
    global _translator, _start_error
    # Ctrl-C reaches the whole process group: the parent alone answers it, in one line
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _exit_with_parent()
        core = cores.get()
        if core is not None:
            os.sched_setaffinity(0, {core})
        try:  # out of memory, the kernel kills a worker (the parent recovers from that), not the parent
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write("500")  # raising one's own score needs no privilege
        except OSError:
            pass
        _translator = factory()
    except Exception as e:  # no thread under a process limit, no memory: the parent says it, once
        _start_error = f"{type(e).__name__}: {e}"


def _unspawnable() -> str | None:
    """Why a spawned worker could not start here, or None. Spawn re-runs the main program in
    each child by its module name or else its file (multiprocessing.spawn), and a program read
    from stdin has neither: every worker would die at start, each death read as a crash."""
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None:
        return None
    path = getattr(main, "__file__", None)
    if path is None or os.path.isfile(os.path.join(mp.process.ORIGINAL_DIR or "", path)):
        return None
    return f"the main program, {path}, is not a file a spawned process can run"


def _exit_with_parent() -> None:
    """Ends this worker when its parent process is gone (module docstring)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch():
        parent.join()  # returns at end of file on the pipe from the parent
        from .lifecycle import release_ops_build
        release_ops_build()
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _ready() -> int:
    """This worker's pid once its translator is built; WorkerStartError if it cannot be."""
    if _start_error is not None:
        raise WorkerStartError(_start_error)
    return os.getpid()


def _call(method: str, arg, translator=None):
    """translator.method(arg); by default this worker's translator."""
    if translator is None:
        _ready()
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
                out = fut.result(timeout=_CHECK_S)
            except WaitTimeout:
                if self.pool._stalled(gen):
                    self.pool._recover(gen, "the pool's manager thread stopped")
                continue
            except BrokenExecutor:
                self.pool._recover(gen)
                continue
            except WorkerStartError as e:
                self.pool._recover(gen, str(e))
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
        """An executor of n worker processes; none (n == 0, or none can be started) = this process."""
        if n > 0 and (why := _unspawnable()):
            _warn(f"translation worker processes cannot start ({why}); translating in this process")
            n = self.n = 0
        if n > 0:
            try:
                return self._processes(n)
            except (OSError, RuntimeError) as e:  # fork or a thread refused (a process limit)
                why = " ".join(str(e).split("\n\n")[0].split()) or type(e).__name__  # its first paragraph
                _warn(f"translation worker processes could not start ({why}); translating in this process")
                self.n = 0
        self._local = self._factory()
        return _InProcess()

    def _processes(self, n: int) -> Executor:
        # spawn, not fork: a forked child inherits torch's OpenMP pool in a broken state
        ctx = mp.get_context("spawn")
        cores = sorted(os.sched_getaffinity(0))
        queue = ctx.SimpleQueue()  # a Queue would start a feeder thread here
        for i in range(n):
            queue.put(cores[i] if len(cores) >= n else None)
        ex = ProcessPoolExecutor(n, mp_context=ctx, initializer=_init, initargs=(self._factory, queue))
        try:
            _start_feeder(ex)
            # start (and load) every worker now, while the parent reads its input; a child
            # inherits the signal mask, so each starts with Ctrl-C blocked (_init then ignores it)
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                for _ in range(n):
                    ex.submit(_ready)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        except BaseException:
            _end(ex)
            raise
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
                seen.update(f.result() for f in [self._executor.submit(_ready) for _ in range(self.n)])
            except (BrokenExecutor, WorkerStartError):  # the first job's result() recovers
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

    def _recover(self, gen: int, start_error: str | None = None) -> None:
        """A worker of generation `gen` died: one worker fewer, every pending job again.
        One that could not build its translator (`start_error`): this process at once."""
        with self._lock:
            if gen != self._gen:  # another job's result() already did it
                return
            old = self._executor
            if start_error is None:
                self.n -= 1
                where = f"{self.n} worker process{'es' if self.n > 1 else ''}" if self.n else "this process"
                _warn(f"a translation worker process died (out of memory?); finishing the input with {where}")
                old.shutdown(wait=False, cancel_futures=True)
            else:
                self.n = 0
                _warn(f"translation worker processes could not start ({start_error}); translating in this process")
                _end(old)
            self._gen += 1
            self._executor = self._start(self.n)
            for job in self._jobs.values():
                if not _succeeded(job.sent[0]):
                    self._send(job)

    def _stalled(self, gen: int) -> bool:
        """Whether generation `gen`'s executor lost the thread that hands its jobs to the
        workers and notices their deaths: its jobs would then wait forever."""
        manager = getattr(self._executor, "_executor_manager_thread", None)
        return gen == self._gen and manager is not None and not manager.is_alive()

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(id(job), None)

    def close(self) -> None:
        with self._lock:
            self._jobs.clear()
            self._executor.shutdown(wait=True, cancel_futures=True)


class _InProcess(Executor):
    """Runs each call at once in the calling thread: the parent's own translator
    needs no thread, which a process limit may refuse."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as e:
            fut.set_exception(e)
        return fut


def _start_feeder(ex: ProcessPoolExecutor) -> None:
    """Starts the thread that feeds the executor's call queue now, in this thread: started
    on its first job by the executor's manager thread instead, a refusal (a process limit)
    would kill that thread and every job would wait forever. RuntimeError if refused."""
    queue = getattr(ex, "_call_queue", None)
    if queue is None or not hasattr(queue, "_start_thread"):
        return  # another Python's internals: its manager thread starts it
    with queue._notempty:  # as Queue.put does
        if queue._thread is None:
            queue._start_thread()


def _end(ex: Executor) -> None:
    """Stops an executor's worker processes now and waits until they are gone: a
    process limit counts them, and the parent is about to start its own threads."""
    for proc in list((getattr(ex, "_processes", None) or {}).values()):
        proc.terminate()
    ex.shutdown(wait=True, cancel_futures=True)


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def _succeeded(fut: Future) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None
