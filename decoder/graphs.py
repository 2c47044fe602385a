"""Capturing decode steps as CUDA graphs (decoder/cache.py StaticCache, StaticGreedy).

`torch.cuda.graph` is made for a few captures at start-up: on entry it waits for
the GPU and empties the caching allocator (and the pinned host cache). The
decoder captures one graph per batch shape, so with it every batch of a
throughput run stopped the host, then cudaMalloc'd its K/V cache and
activations afresh. `capture` calls the graph's own capture_begin/capture_end
instead (as vLLM and ReaLHF do), on one side stream and into one memory pool
per model that every graph shares (held open by a graph kept with the model):
one batch decodes at a time per model, and each replay's output is used before
the next replay, so graphs may reuse each other's intermediates' memory. The
collector is paused meanwhile: a finaliser run mid-capture must not free memory
into the graph.

A capture must not be the first run of its work on its stream (cuBLAS makes its
handle and workspace then): the states run a batch's first step (or block of
steps) eagerly through `warm`, on the same stream, and capture at the second.
So no step is run twice, and a batch whose cap allows one block only captures nothing.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .modeldir import first_line


def stream_of(model) -> "torch.cuda.Stream":
    """The model's capture stream, made on first use: warm-ups and captures run on it."""
    if model.graph_stream is None:
        model.graph_stream = torch.cuda.Stream(device=model.device)  # the model's GPU, not the current one
    return model.graph_stream


def pool_of(model) -> object:
    """The model's graph memory pool, made on first use with a graph that holds it open.

    The caching allocators (the device's and, in torch 2.11, the pinned host memory's) count
    the graphs captured into a pool. When a batch's graphs were freed, the count fell to 0 and
    the pool stayed listed until the cache was emptied, which `torch.cuda.graph` did before
    every capture and `capture` does not: the next capture into it hit an internal assert
    (`use_count > 0`, torch 2.11 on an H200), and every run decoded without graphs after its
    first batch. `torch.cuda.MemPool` holds the device's count only; a one-kernel graph
    captured into the pool first and kept with the model holds both."""
    if model.graph_pool is None:
        pool, anchor = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
        with on_capture_stream(model):
            one_kernel()  # its warm-up: a kernel's first launch (lazy module loading) is not captured
            anchor.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                one_kernel()
            finally:
                anchor.capture_end()
        model.graph_pool, model.graph_anchor = pool, anchor
    return model.graph_pool


def one_kernel() -> None:
    """The anchor graph's work: a graph without a kernel warns on capture."""
    torch.zeros(1, device="cuda")  # run on the capture stream: its GPU is the current device then


@contextlib.contextmanager
def on_capture_stream(model):
    """The model's capture stream current (and its GPU the current device), after the work
    queued before on the model's GPU; that work's stream waits for it after."""
    side, main = stream_of(model), torch.cuda.current_stream(model.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield
    main.wait_stream(side)


def warm(fn: Callable[[], torch.Tensor], model) -> torch.Tensor:
    """fn run eagerly on the model's capture stream."""
    with on_capture_stream(model):
        return fn()


def capture(fn: Callable[[], torch.Tensor], model) -> tuple["torch.cuda.CUDAGraph", torch.Tensor]:
    """fn's CUDA work captured, not run, on the model's capture stream into its pool:
    (the graph, fn's output, which each replay rewrites). Warm fn up first (`warm`)."""
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        pool = pool_of(model)
        with on_capture_stream(model):
            # thread_local: a CUDA call of another thread (the text pipeline's, a user's) cannot spoil it
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    return graph, out


@dataclass
class Tally:
    """A model's graph captures so far and the host's seconds in them: a capture records the
    step's launches and instantiates the graph while the GPU may wait, once per state (a batch's
    shape). The GPU bench reports them a pass."""
    count: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds


class Captured:
    """method(*args) as the states replay it: the first call runs it eagerly on the capture stream
    (the warm-up), the second captures it and replays it, every later call replays it; the
    output is where it left it (a replay rewrites it). Where a capture fails (a CUDA or torch
    version whose graphs refuse an op), one warning, and this model's steps run eagerly from
    then on: slower, the same tokens, no crash.

    `method` is a method of the object that holds this graph (a state, a search loop), held
    weakly: a strong reference would close a cycle, and the object, its K/V buffers and its
    graphs would outlive their batch until the collector's next full pass."""

    def __init__(self, method: Callable[..., torch.Tensor], model, *args):
        self.method, self.args, self.model = weakref.WeakMethod(method), args, model
        self.graph = self.out = None
        self.warmed = False

    def fn(self) -> torch.Tensor:
        return self.method()(*self.args)  # its owner is alive: it is the caller

    def __call__(self) -> torch.Tensor:
        if self.model.graphs_failed:
            return self.fn()
        if self.graph is None:
            if not self.warmed:
                self.warmed = True
                return warm(self.fn, self.model)
            if not self.capture():  # nothing ran while capturing: the step runs now, eagerly
                return self.fn()
        self.graph.replay()
        return self.out

    def capture(self) -> bool:
        """Captures fn (warmed up already); whether a graph is ready to replay."""
        t = time.perf_counter()
        try:
            self.graph, self.out = capture(self.fn, self.model)
            self.model.captures.add(time.perf_counter() - t)
        except RuntimeError as e:
            self.model.graphs_failed = True
            print(f"warning: CUDA graph capture failed ({first_line(e)}); decoding without graphs",
                  file=sys.stderr, flush=True)
        return self.graph is not None
