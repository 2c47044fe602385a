"""Pinned single-thread worker processes: CPU-ALL as one model copy per core.

At student sizes one matrix product is too small to keep several intra-op
threads busy, and the threads wait for one another at every op; independent
batches on pinned cores do not wait (docs/container.md: 1.2-1.4x on 2 cores).
The parent reads, encodes, forms the batches and decodes the text exactly as
one process would; the workers only run `Translator.translate_ids` on whole
batches. A batch's output therefore does not depend on how many workers there
are, and the result equals a one-process run with one thread.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import Future, ProcessPoolExecutor

_translator = None  # this worker's own Translator


def _init(model_dir: str, precision: str, switches: dict, cores) -> None:
    core = cores.get()
    if core is not None:
        os.sched_setaffinity(0, {core})
    from .translator import Translator
    global _translator
    _translator = Translator(model_dir, device="cpu", precision=precision, threads=1, **switches)


def _translate_ids(srcs: list[list[int]]) -> list[list[int]]:
    return _translator.translate_ids(srcs)


class WorkerPool:
    """`n` processes, each pinned to one core of this process's affinity mask
    when there are at least `n` of them (else the scheduler places them)."""

    def __init__(self, model_dir: str, n: int, precision: str, switches: dict):
        # spawn, not fork: a forked child inherits torch's OpenMP pool in a broken state
        ctx = mp.get_context("spawn")
        cores = sorted(os.sched_getaffinity(0))
        queue = ctx.Queue()
        for i in range(n):
            queue.put(cores[i] if len(cores) >= n else None)
        self.n = n
        self._pool = ProcessPoolExecutor(n, mp_context=ctx, initializer=_init,
                                         initargs=(model_dir, precision, switches, queue))
        for _ in range(n):  # start (and load) every worker now, while the parent reads its input
            self._pool.submit(int)

    def submit(self, srcs: list[list[int]]) -> Future:
        return self._pool.submit(_translate_ids, srcs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
