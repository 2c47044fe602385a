"""Capturing a decode step as a CUDA graph (decoder/cache.py StaticCache).

`torch.cuda.graph` is made for a few captures at start-up: on entry it waits for
the GPU and empties the caching allocator (and the pinned host cache). The
decoder captures one graph per batch shape, so with it every batch of a
throughput run stopped the host, then cudaMalloc'd its K/V cache and
activations afresh. `capture` calls the graph's own capture_begin/capture_end
instead (as vLLM and ReaLHF do), into one memory pool per model that every
graph shares: one batch decodes at a time per model, and each replay's output
is copied before the next replay, so graphs may reuse each other's
intermediates' memory. The collector is paused meanwhile: a finaliser run
mid-capture must not free memory into the graph.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

WARMUP_STEPS = 2  # eager runs before a capture: lazy initialisation (cuBLAS handles, workspaces) kept out of it


def capture(fn: Callable[[], torch.Tensor], pool, warmup: int = WARMUP_STEPS
            ) -> tuple["torch.cuda.CUDAGraph", torch.Tensor]:
    """fn's CUDA work, run `warmup` times, then captured on a side stream into `pool`
    (`torch.cuda.graph_pool_handle()`): (the graph, fn's output, which each replay rewrites).
    The warm-up runs really happen: fn must be harmless to repeat, or its caller resets."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        try:
            # thread_local: a CUDA call of another thread (the text pipeline's, a user's) cannot spoil it
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
        finally:
            if collecting:
                gc.enable()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def pool_of(model) -> object:
    """The model's graph memory pool, made on first use."""
    if model.graph_pool is None:
        model.graph_pool = torch.cuda.graph_pool_handle()
    return model.graph_pool
