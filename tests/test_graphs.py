"""decoder/graphs.py: how a step is captured, checked on CPU against a stand-in for
torch.cuda's graph API: warm-up, one shared pool, no device-wide wait or cache
emptying per capture, the collector paused, the capture always closed."""
import contextlib
import gc
import os
from types import SimpleNamespace

import pytest
import torch

from decoder import Translator, graphs, hostsync, search
from decoder import state as cache

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
MODEL, SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")
trained = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "config.json")),
                             reason="trained fixture tests/fixtures/bible-tiny is absent")


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
            def __init__(self, device=None):
                self.device = device

            def wait_stream(self, other):
                cuda.calls.append(("wait",))

        self.CUDAGraph, self.Stream = Graph, Stream
        self.current_stream = lambda device=None: (cuda.calls.append(("current", device)), Stream(device))[1]
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
    monkeypatch.setattr(graphs, "one_kernel", lambda: fake.calls.append(("kernel",)))
    return fake


def model(device="cuda:1"):
    return SimpleNamespace(graph_pool=None, graph_anchor=None, graph_stream=None, device=device)


def test_capture_records_into_the_models_pool_without_waiting_or_emptying_the_cache(cuda):
    runs, m = [], model()

    def step():
        runs.append(gc.isenabled())
        return torch.ones(2)

    graph, out = graphs.capture(step, m)
    assert runs == [False] and torch.equal(out, torch.ones(2))  # the collector paused while capturing
    begin = [c for c in cuda.calls if c[0] == "begin"]
    assert begin[-1] == ("begin", m.graph_pool, "thread_local", False) and gc.isenabled()
    assert cuda.calls[-2][0] == "end"
    graphs.capture(step, m)
    assert [c[1] for c in cuda.calls if c[0] == "begin"][-1] is m.graph_pool  # one pool for all its graphs


def test_the_models_pool_is_held_open_by_a_graph_captured_first_and_kept(cuda):
    # the allocators drop a pool's count to 0 with its last graph, and a capture into it then fails
    m = model()
    graphs.capture(lambda: torch.ones(2), m)
    graphs.capture(lambda: torch.ones(2), m)
    calls = [c for c in cuda.calls if c[0] != "current"]
    assert calls[:5] == [("wait",), ("kernel",), ("begin", m.graph_pool, "thread_local", False), ("kernel",),
                         ("end", False)]  # the anchor, warmed up: the pool's first graph, a kernel in it
    assert isinstance(m.graph_anchor, cuda.CUDAGraph)
    assert len([c for c in cuda.calls if c[0] == "kernel"]) == 2  # one anchor per model


def test_capture_is_closed_and_the_collector_restored_when_the_step_fails(cuda):
    def step():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        graphs.capture(step, model())
    assert cuda.calls[-1] == ("end", False) and gc.isenabled()


def test_warm_up_runs_on_the_capture_stream_and_each_model_keeps_its_own(cuda):
    m = model()
    assert torch.equal(graphs.warm(lambda: torch.zeros(3), m), torch.zeros(3))
    first, pool = graphs.stream_of(m), graphs.pool_of(m)
    assert first is not None and graphs.stream_of(m) is first and graphs.pool_of(m) is pool
    # the model's GPU, whichever is current: its stream, and the work before it on that GPU waited for
    assert first.device == "cuda:1" and {c[1] for c in cuda.calls if c[0] == "current"} == {"cuda:1"}
    other = model()
    assert graphs.stream_of(other) is not first and graphs.pool_of(other) is not pool


class Replay:
    """A captured step stood in for on CPU. Capturing runs nothing, as on a GPU; a
    replay runs the step and leaves its output where the capture's output stands."""

    def __init__(self, fn):
        self.fn, self.value = fn, None

    def replay(self):
        self.value = self.fn()

    def clone(self):  # the capture's output, read after a replay
        return self.value.clone()


def on_cpu_with_graphs(monkeypatch) -> dict:
    """StaticCache's graph path on CPU: warm-ups and captures recorded per model."""
    seen = {"warm": [], "capture": []}
    init = cache.StaticCache.__init__

    def build(self, *a, **k):
        init(self, *a, **k)
        self.use_graph = True

    def fake_capture(fn, model):
        seen["capture"].append(id(model))
        graph = Replay(fn)
        return graph, graph
    monkeypatch.setattr(cache.StaticCache, "__init__", build)
    monkeypatch.setattr(graphs, "capture", fake_capture)
    monkeypatch.setattr(graphs, "warm", lambda fn, model: (seen["warm"].append(id(model)), fn())[1])
    return seen


def eager_outputs(kw: dict, n: int):
    """The first n test lines' ids, and the static state's outputs without graphs: each line
    alone, then all in one batch."""
    with open(SRC, encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh][:n]
    eager = Translator(MODEL, static_shapes=True, **kw)
    srcs = eager.text.encode(lines)
    return srcs, [eager.translate_ids([s])[0] for s in srcs] + [eager.translate_ids(srcs)]


# the searches' whole steps on the static state
LOOPS = [dict(beam=1), dict(beam=4)]


@trained
@pytest.mark.parametrize("kw", LOOPS)
def test_static_state_replaying_its_captured_step_gives_the_eager_tokens(kw, monkeypatch):
    srcs, want = eager_outputs(kw, 12)
    seen = on_cpu_with_graphs(monkeypatch)
    tr = Translator(MODEL, static_shapes=True, **kw)
    got = [tr.translate_ids([s])[0] for s in srcs] + [tr.translate_ids(srcs)]
    assert got == want
    shapes = {(len(s), int(tr.limits([len(s)])[0])) for s in srcs}
    # a graph's first call warms up, its second captures; kept states capture once (the beam loop
    # has two graphs: before the first limit and from it on)
    graphs_a_state = 2 if kw["beam"] > 1 else 1
    assert 0 < len(seen["capture"]) <= len(seen["warm"]) <= graphs_a_state * (len(shapes) + 1)
    assert set(seen["capture"]) == {id(tr.model)}


@trained
@pytest.mark.parametrize("kw", [dict(sync_every=64),  # a block longer than any output
                                dict(sync_every=8, max_len_a=0.0, max_len_b=8)])  # a cap of one block
def test_a_batch_ending_within_its_first_block_captures_nothing(kw, monkeypatch):
    seen = on_cpu_with_graphs(monkeypatch)
    tr = Translator(MODEL, precision="fp32", static_shapes=True, **kw)
    with open(SRC, encoding="utf-8") as fh:
        srcs = tr.text.encode([line.rstrip("\n") for line in fh][:6])
    caps = {k: v for k, v in kw.items() if k.startswith("max_len")}
    assert tr.translate_ids(srcs) == Translator(MODEL, precision="fp32", **caps).translate_ids(srcs)
    assert seen == {"warm": [id(tr.model)], "capture": []}


# -- greedy's whole step on the fixed-shape state, a block of steps a run ---------------------------

def counting_run(monkeypatch) -> list:
    """The position each block of greedy steps starts at."""
    runs = []
    block = search.Greedy.block
    monkeypatch.setattr(search.Greedy, "block",
                        lambda self, every: (runs.append(int(self.state.cache.pos)), block(self, every))[1])
    return runs


@trained
@pytest.mark.parametrize("every", [1, 3, 8])
def test_whole_greedy_steps_in_blocks_give_the_per_step_tokens(every, monkeypatch):
    with open(SRC, encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh][:24]
    plain = Translator(MODEL, precision="fp32")
    srcs = [s for s in plain.text.encode(lines) if s]
    want = plain.translate_ids(srcs[:16]) + [plain.translate_ids([s])[0] for s in srcs[16:]]
    tr = Translator(MODEL, precision="fp32", static_shapes=True, sync_every=every)
    assert tr.state_kind(16) == "static" and tr.plan.states.every == every and "fixed-shape state" in tr.plan.summary()
    runs = counting_run(monkeypatch)
    hostsync.reset()
    got = tr.translate_ids(srcs[:16])
    # a read after each block, the outputs once; a block of `every` steps a run
    assert hostsync.total() == len(runs) + 1 and runs == list(range(0, every * len(runs), every))
    longest = max(len(x) for x in got) + 1  # its steps, </s> included
    assert len(runs) == -(-longest // every)
    got += [tr.translate_ids([s])[0] for s in srcs[16:]]
    assert got == want


def test_a_block_past_the_last_position_is_clamped_and_its_outputs_unused(tmp_path):
    """A cache rounded up to whole blocks may run steps past the position table: they read
    its last row and write nothing that is kept. Random weights: some sentences run to the
    length cap, which here is the table's last position."""
    from fixture_model import make_model_dir, synthetic_corpus
    d = make_model_dir(tmp_path / "m", max_positions=40)
    kw = dict(max_len_a=0.0, max_len_b=100)  # every limit capped at the last position, 39
    tr = Translator(d, static_shapes=True, sync_every=7, **kw)  # blocks up to step 41
    srcs = tr.text.encode(synthetic_corpus(12))
    got = tr.translate_ids(srcs)
    assert max(len(x) for x in got) == 38  # a sentence ran to its cap: the last block went past it
    assert got == Translator(d, **kw).translate_ids(srcs)


@trained
def test_the_static_cache_holds_whole_blocks_of_steps():
    tr = Translator(MODEL, precision="fp32", static_shapes=True, sync_every=8)
    src = tr.text.encode(["In the beginning God created the heaven and the earth."])
    lims = tr.limits([len(src[0])])
    built = []
    new = cache.StaticCache.__init__

    def record(self, model, enc, mask, beam, max_len, graphs=True):
        built.append(max_len)
        new(self, model, enc, mask, beam, max_len, graphs)
    try:
        cache.StaticCache.__init__ = record
        tr.translate_ids(src)
    finally:
        cache.StaticCache.__init__ = new
    assert built == [-(-int(lims[0]) // 8) * 8]


@trained
@pytest.mark.parametrize("every,caps", [(1, {}), (8, {}), (3, dict(max_len_a=0.3, max_len_b=1))])
def test_whole_beam_steps_give_the_per_step_hypotheses(every, caps):
    """caps: limits short enough that sentences are cut, so </s> is forced at different steps."""
    with open(SRC, encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh][:24]
    plain = Translator(MODEL, precision="fp32", beam=4, **caps)
    srcs = [s for s in plain.text.encode(lines) if s]
    want = plain.translate_ids(srcs[:16]) + [plain.translate_ids([s])[0] for s in srcs[16:20]]
    if caps:
        lims = plain.limits([len(s) for s in srcs[:16]])
        assert len(set(lims.tolist())) > 1 and sum(len(w) + 1 == lim for w, lim in zip(want, lims.tolist())) > 1
    tr = Translator(MODEL, precision="fp32", beam=4, static_shapes=True, sync_every=every, **caps)
    assert tr.state_kind(16) == "static" and "fixed-shape state" in tr.plan.summary()
    hostsync.reset()
    got = tr.translate_ids(srcs[:16])
    assert hostsync.counts["outputs"] == 2 and hostsync.counts["finished mask"] >= 1
    if every > 1:  # a read every `every` steps: fewer than one a step
        steps = max(len(x) for x in got) + 1
        assert hostsync.counts["finished mask"] <= -(-steps // every) + 1
    got += [tr.translate_ids([s])[0] for s in srcs[16:20]]
    assert got == want


@trained
@pytest.mark.parametrize("kw", LOOPS)
def test_a_failed_capture_warns_once_and_the_steps_run_eagerly(kw, monkeypatch, capsys):
    srcs, want = eager_outputs(kw, 8)
    seen = on_cpu_with_graphs(monkeypatch)

    def refuse(fn, model):
        seen["capture"].append(id(model))
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(graphs, "capture", refuse)
    tr = Translator(MODEL, static_shapes=True, **kw)
    assert [tr.translate_ids([s])[0] for s in srcs] + [tr.translate_ids(srcs)] == want
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: CUDA graph capture failed (operation not permitted when stream is capturing); "
                   "decoding without graphs"]
    assert len(seen["capture"]) == 1 and tr.model.graphs_failed  # tried once, never again


@trained
@pytest.mark.parametrize("kw", [dict(beam=1), dict(beam=4)])
def test_the_model_tallies_its_captures_and_the_hosts_seconds_in_them(kw, monkeypatch):
    """What the GPU bench reports a pass: each new state's graphs show their cost."""
    import time
    seen = on_cpu_with_graphs(monkeypatch)
    fake = graphs.capture

    def slow(fn, model):
        time.sleep(0.01)
        return fake(fn, model)
    monkeypatch.setattr(graphs, "capture", slow)
    tr = Translator(MODEL, static_shapes=True, **kw)
    with open(SRC, encoding="utf-8") as fh:
        srcs = tr.text.encode([line.rstrip("\n") for line in fh][:12])
    tr.translate_ids(srcs)
    n = len(seen["capture"])
    assert n > 0 and tr.model.captures.count == n and tr.model.captures.seconds >= 0.01 * n
    monkeypatch.setattr(graphs, "capture", lambda fn, model: (_ for _ in ()).throw(RuntimeError("refused")))
    tr.translate_ids(srcs[:3])  # a failed capture is not a capture
    assert tr.model.captures.count == n and tr.model.graphs_failed


@trained
@pytest.mark.parametrize("beam", [1, 4])
def test_static_state_attending_through_the_decode_kernel_keeps_the_tokens(beam):
    with open(SRC, encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh][:16]
    kw = dict(beam=beam, static_shapes=True)
    sdpa = Translator(MODEL, graph_attention=False, **kw)
    kernel = Translator(MODEL, **kw)
    assert kernel.plan.states.masked_attend and not sdpa.plan.states.masked_attend
    assert "attend" in dict(kernel.plan.bound)
    srcs = sdpa.text.encode(lines)
    assert kernel.translate_ids(srcs) == sdpa.translate_ids(srcs)
    assert [kernel.translate_ids([s])[0] for s in srcs[:6]] == [sdpa.translate_ids([s])[0] for s in srcs[:6]]


def test_graph_attention_resolves_on_the_fixed_shape_state_with_the_attention_kernel_only():
    from decoder.optimisations import Kernels, Switches, resolve
    both = Kernels(cpu=True, cuda=True)
    masked = lambda **kw: resolve(**{"kernels": both, **kw}).states.masked_attend  # noqa: E731
    assert masked(switches=Switches(graph_attention=True), device="cuda")
    assert masked(switches=Switches(), device="cuda")  # on by default
    assert not masked(switches=Switches(graph_attention=True, fused_attention=False), device="cuda")
    assert not masked(switches=Switches(graph_attention=True), device="cpu")  # no fixed-shape state there
    # without the CUDA kernels its reference would read the whole cache, as SDPA does, in more kernels
    assert not masked(switches=Switches(), device="cuda", kernels=Kernels(cpu=True, cuda=False))


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    from fixture_model import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("fixture") / "model", seed=1)


@pytest.mark.parametrize("kw", [dict(beam=1), dict(beam=4)])
def test_a_batchs_fixed_shape_state_is_freed_with_the_batch_without_the_collector(fixture_dir, kw, monkeypatch):
    # its K/V buffers (GBs a batch on a GPU) must not wait for the collector's next full pass, which
    # a cycle between the state, its loop and their graphs made them do
    import weakref
    from fixture_model import synthetic_corpus
    made, init = [], cache.StaticCache.__init__
    monkeypatch.setattr(cache.StaticCache, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), made.append(weakref.ref(self)))[0])
    tr = Translator(fixture_dir, static_shapes=True, max_sentences=24, **kw)
    gc.disable()
    try:
        tr.translate(synthetic_corpus(64, seed=3))
        kept = list(tr.model.static_states.values())  # graph_reuse's: states of at most 16 rows
        assert len(made) > len(kept) and all(c.kept for c in kept)
        assert [r for r in made if r() is not None and r() not in kept] == []
    finally:
        gc.enable()


def test_a_kept_state_pushed_out_by_newer_shapes_is_freed_without_the_collector(fixture_dir, monkeypatch):
    import dataclasses
    import weakref
    from fixture_model import synthetic_corpus
    made, init = [], cache.StaticCache.__init__
    monkeypatch.setattr(cache.StaticCache, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), made.append(weakref.ref(self)))[0])
    tr = Translator(fixture_dir, precision="fp32", static_shapes=True)
    plan = tr.model.plan  # graph_reuse keeps one shape
    tr.model.plan = dataclasses.replace(plan, states=dataclasses.replace(plan.states, keep_states=1))
    lines = sorted(synthetic_corpus(40, seed=5), key=len)
    gc.disable()
    try:
        for line in (lines[0], lines[-1]):  # two shapes, one sentence each
            tr.translate([line])
        assert len(made) == 2 and made[0]() is None and made[1]().kept
    finally:
        gc.enable()
