"""Static states kept per batch shape (switch graph_reuse, decoder/state.py `static_cache`).

On CUDA every batch built its fixed-shape state and captured a graph for it: at one
sentence a batch that was most of the time (H200, 2026-11-26: batch 1 at 0.14x
CTranslate2). A batch of a shape seen before now reloads a kept state in place, so its
captured graph replays. Here the fixed-shape state runs eagerly on CPU (static_shapes):
the same code, the graph left out."""
import dataclasses
import os

import pytest

from decoder import Translator
from decoder import state as cache
from decoder.optimisations import Kernels, Switches, resolve

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
MODEL, SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")
trained = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "config.json")),
                             reason="trained fixture tests/fixtures/bible-tiny is absent")
BOTH = Kernels(cpu=True, cuda=True)


@pytest.fixture(scope="module")
def srcs():
    with open(SRC, encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh][:30]
    return Translator(MODEL, precision="fp32").text.encode(lines)


def count_builds(monkeypatch) -> list:
    built = []
    init = cache.StaticCache.__init__

    def counting(self, *a, **k):
        built.append(1)
        init(self, *a, **k)
    monkeypatch.setattr(cache.StaticCache, "__init__", counting)
    return built


def test_graph_reuse_resolves_only_where_the_state_is_static():
    assert resolve(Switches(), device="cuda", kernels=BOTH).states.keep_states == 64
    assert "graph_reuse" in resolve(Switches(), device="cuda", kernels=BOTH).runs
    assert resolve(Switches(graph_reuse=False), device="cuda", kernels=BOTH).states.keep_states == 0
    assert resolve(Switches(cuda_graphs=False), device="cuda", kernels=BOTH).states.keep_states == 0
    cpu = resolve(Switches(), device="cpu", kernels=BOTH)
    assert cpu.states.keep_states == 0 and "graph_reuse" not in cpu.runs
    assert resolve(Switches(), device="cpu", kernels=BOTH, static_shapes=True).states.keep_states == 64


@trained
@pytest.mark.parametrize("beam", [1, 4])
def test_sentences_of_a_shape_seen_before_reuse_its_state_and_give_the_same_tokens(srcs, beam, monkeypatch):
    built = count_builds(monkeypatch)
    tr = Translator(MODEL, precision="fp32", beam=beam, static_shapes=True)
    first = [tr.translate_ids([s])[0] for s in srcs]
    shapes = {(len(s), int(tr.limits([len(s)])[0])) for s in srcs}
    assert len(built) == len(shapes) < len(srcs)  # one state per shape, not per sentence
    again = [tr.translate_ids([s])[0] for s in reversed(srcs)][::-1]
    assert len(built) == len(shapes)  # every shape kept: nothing built the second time
    fresh = Translator(MODEL, precision="fp32", beam=beam, static_shapes=True, graph_reuse=False)
    assert first == again == [fresh.translate_ids([s])[0] for s in srcs]
    assert first[:8] == [Translator(MODEL, precision="fp32", beam=beam).translate_ids([s])[0] for s in srcs[:8]]  # the plain state


@trained
def test_big_batches_are_not_kept_and_the_least_recently_used_shape_leaves_first(srcs, monkeypatch):
    built = count_builds(monkeypatch)
    tr = Translator(MODEL, precision="fp32", static_shapes=True)
    big = srcs[:cache.STATIC_KEEP_ROWS + 1]
    tr.translate_ids(big), tr.translate_ids(big)
    assert len(built) == 2 and not tr.model.static_states
    tr.model.plan = dataclasses.replace(tr.model.plan, states=dataclasses.replace(tr.model.plan.states, keep_states=2))
    by_len = {len(s): s for s in srcs}
    a, b, c = (by_len[n] for n in sorted(by_len)[:3])
    for s in (a, b, a, c, a, b):  # c pushes out b, the least recently used; b then comes back
        tr.translate_ids([s])
    assert len(built) == 2 + 4 and len(tr.model.static_states) == 2
