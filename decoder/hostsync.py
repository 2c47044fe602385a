"""Every device-to-host read of the decode loop, counted.

On CUDA a read (`.tolist()`, `int(t)`, `bool(t.any())`) waits for every kernel
queued before it: the host stops issuing work and the GPU then idles while it
catches up. The searches (decoder/search.py), the states (decoder/cache.py)
and the Translator's batch steps read only through this module, so the tests can
count the reads a batch makes (`reset`, `counts`): the device-style loops
(plan.every > 1) make one per `sync_every` steps plus a few per batch.
On CPU a read is a memory access, so the count is all it costs.

A batch's outputs leave through `later`: the copy is queued behind the kernels
that write them and read where they are used (the text pipeline's thread), so
the host goes on to the next batch while the GPU finishes this one.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch

counts: Counter = Counter()  # reads per kind since the last reset


def reset() -> None:
    counts.clear()


def total() -> int:
    return sum(counts.values())


def item(t: torch.Tensor, kind: str):
    """The one element of t as a Python number (int, float or bool)."""
    counts[kind] += 1
    return t.item()


def to_list(t: torch.Tensor, kind: str) -> list:
    """t as (nested) Python lists."""
    counts[kind] += 1
    return t.tolist()


def to_cpu(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t copied to the host as a tensor."""
    counts[kind] += 1
    return t.cpu()


class Later:
    """A device tensor on its way to the host: copied into pinned memory behind the kernels
    queued before it; `tolist` waits for that copy only (counted once, when queued)."""

    def __init__(self, t: torch.Tensor, kind: str):
        counts[kind] += 1
        self.event = None
        if t.device.type != "cuda":
            self.host = t.clone()  # a kept state's buffer may be rewritten by the next batch first
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event(blocking=True)  # its waiter sleeps (GIL released), not spins
        self.event.record(torch.cuda.current_stream(t.device))  # the copy's stream: t's GPU, not the current

    def tolist(self) -> list:
        self.wait()
        return self.host.tolist()

    def array(self) -> np.ndarray:
        """The host copy as a numpy array (shares its memory)."""
        self.wait()
        return self.host.numpy()

    def until(self, stop: int) -> list[list[int]]:
        """Each row of a (rows, T) tensor up to its first `stop` (all of it without one). A row
        at a time: the text pipeline's thread runs this while the decoding thread waits for the
        GIL, and one `tolist` of the whole batch holds it for milliseconds (4x slower, too)."""
        self.wait()
        a = self.host.numpy()
        hit = a == stop  # (rows, T)
        ends = np.where(hit.any(1), hit.argmax(1), a.shape[1])  # (rows,)
        return [row[:n].tolist() for row, n in zip(a, ends.tolist())]

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def later(t: torch.Tensor, kind: str) -> Later:
    return Later(t, kind)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`, queued: PyTorch's copy from pageable memory to a GPU
    synchronises the stream after it, so each batch's inputs would wait for every kernel
    of the batch before; from pinned memory the copy is non-blocking."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
