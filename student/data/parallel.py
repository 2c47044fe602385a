"""Work spread over this process's cores: chunks in, results out in order.

Pool.imap keeps the input order and, given a lazy input, never holds more than
the chunks in flight (a bounded window here: imap alone would read the whole
input ahead). One core, or too little work to pay for starting the workers
(spawned: the parent may hold torch's threads), runs in-process.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from typing import Callable, Iterable, Iterator

from decoder import cgroup


def workers() -> int:
    """Cores for this process: its CPU affinity capped by the cgroup's CPU quota, as the
    container's CPU-ALL counts them, shared among the torchrun ranks of the machine."""
    cores = cgroup.usable_cores() if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def imap_ordered(fn: Callable, tasks: Iterable, n_workers: int, initializer=None, initargs=()) -> Iterator:
    """fn(task) for each task, in order; n_workers processes (1 = here). At most
    4 * n_workers tasks are read ahead of the results taken."""
    if n_workers <= 1:
        if initializer:
            initializer(*initargs)
        yield from map(fn, tasks)
        return
    tasks = iter(tasks)
    with mp.get_context("spawn").Pool(n_workers, initializer, initargs) as pool:
        window = []
        for task in itertools.islice(tasks, 4 * n_workers):
            window.append(pool.apply_async(fn, (task,)))
        while window:
            result = window.pop(0).get()
            for task in itertools.islice(tasks, 1):
                window.append(pool.apply_async(fn, (task,)))
            yield result
