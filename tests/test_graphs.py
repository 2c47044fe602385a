"""decoder/graphs.py: how a step is captured, checked on CPU against a stand-in for
torch.cuda's graph API: warm-up, one shared pool, no device-wide wait or cache
emptying per capture, the collector paused, the capture always closed."""
import contextlib
import gc
import os
from types import SimpleNamespace

import pytest
import torch

from decoder import Translator, cache, graphs

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
MODEL, SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")


class FakeCuda:
    """The torch.cuda calls `capture` may make, recorded; the ones it must not make refuse."""

    def __init__(self):
        self.calls = []
        cuda = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                cuda.calls.append(("begin", pool, capture_error_mode, gc.isenabled()))

            def capture_end(self):
                cuda.calls.append(("end", gc.isenabled()))

        class Stream:
            def wait_stream(self, other):
                cuda.calls.append(("wait",))

        self.CUDAGraph, self.Stream = Graph, Stream
        self.current_stream = Stream
        self.stream = lambda s: contextlib.nullcontext()
        self.graph_pool_handle = lambda: object()

    def refuse(self, name):
        def call(*a, **k):
            raise AssertionError(f"capture called torch.cuda.{name}")
        return call


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("CUDAGraph", "Stream", "current_stream", "stream", "graph_pool_handle"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    for name in ("synchronize", "empty_cache", "graph"):
        monkeypatch.setattr(torch.cuda, name, fake.refuse(name))
    return fake


def test_capture_warms_up_then_captures_into_the_pool_without_emptying_the_cache(cuda):
    runs, pool = [], object()

    def step():
        runs.append(gc.isenabled())
        return torch.ones(2)

    graph, out = graphs.capture(step, pool)
    assert len(runs) == graphs.WARMUP_STEPS + 1 and torch.equal(out, torch.ones(2))
    begin = [c for c in cuda.calls if c[0] == "begin"]
    assert begin == [("begin", pool, "thread_local", False)]  # the collector paused while capturing
    assert runs[-1] is False and gc.isenabled()  # ... and running again after
    assert cuda.calls[-2][0] == "end"


def test_capture_is_closed_and_the_collector_restored_when_the_step_fails(cuda):
    n = []

    def step():
        n.append(1)
        if len(n) > graphs.WARMUP_STEPS:
            raise RuntimeError("step failed")
        return torch.zeros(1)

    with pytest.raises(RuntimeError, match="step failed"):
        graphs.capture(step, None)
    assert cuda.calls[-1] == ("end", False) and gc.isenabled()


def test_every_graph_of_a_model_shares_one_pool(cuda):
    model = SimpleNamespace(graph_pool=None)
    first = graphs.pool_of(model)
    assert first is not None and graphs.pool_of(model) is first
    assert graphs.pool_of(SimpleNamespace(graph_pool=None)) is not first


class Replay:
    """A captured step stood in for on CPU: replay runs the step again into its output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


@pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "config.json")), reason="trained fixture is absent")
@pytest.mark.parametrize("beam", [1, 4])
def test_static_state_replaying_its_captured_step_gives_the_eager_tokens(beam, monkeypatch):
    captured = []

    def fake_capture(fn, pool):
        out = fn()
        captured.append(pool)
        return Replay(fn, out), out
    init = cache.StaticCache.__init__

    def on_cpu_with_graphs(self, *a, **k):
        init(self, *a, **k)
        self.use_graph = True
    monkeypatch.setattr(graphs, "capture", fake_capture)
    monkeypatch.setattr(graphs, "pool_of", lambda model: id(model))
    with open(SRC, encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh][:12]
    eager = Translator(MODEL, beam=beam, static_shapes=True)
    srcs = eager.text.encode(lines)
    want = [eager.translate_ids([s])[0] for s in srcs] + [eager.translate_ids(srcs)]
    monkeypatch.setattr(cache.StaticCache, "__init__", on_cpu_with_graphs)
    tr = Translator(MODEL, beam=beam, static_shapes=True)
    got = [tr.translate_ids([s])[0] for s in srcs] + [tr.translate_ids(srcs)]
    assert got == want
    shapes = {(len(s), int(tr.limits([len(s)])[0])) for s in srcs}
    assert len(captured) == len(shapes) + 1 and set(captured) == {id(tr.model)}  # one per state, one pool
