"""The latency mode (one sentence per call, greedy): the one-row loop and state
(decoder/search.py `greedy_one`, decoder/state.py OneRowCache) give the batch
path's tokens, and each of their switches alone leaves the tokens unchanged."""
import os
import shutil

import pytest
import torch

from decoder import Translator, modeldir
from decoder.state import OneRowCache
from fixture_model import make_model_dir, synthetic_corpus

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
TRAINED, TRAINED_SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")
BATCH_PATH = dict(one_row=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model_dir(tmp_path_factory.mktemp("batch1") / "model", seed=4, enc=1, dec=2)


@pytest.fixture(scope="module")
def srcs(model_dir):
    return Translator(model_dir, precision="fp32").text.encode(synthetic_corpus(30, seed=5))


def one_by_one(tr, srcs):
    return [tr.translate_ids([s])[0] for s in srcs]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("switches", [dict(one_row=True, one_row_layer=False, fused_attention=False),
                                      dict(one_row=True, one_row_layer=False),
                                      dict(one_row=True, fused_project_argmax=False)],
                         ids=["loop", "loop+attention", "all+full_logits"])
def test_one_row_greedy_gives_the_batch_greedy_tokens(model_dir, srcs, precision, switches):
    ref = one_by_one(Translator(model_dir, precision=precision, **BATCH_PATH), srcs)
    assert one_by_one(Translator(model_dir, precision=precision, **switches), srcs) == ref


def test_one_row_greedy_stops_at_the_length_cap_as_the_batch_greedy(model_dir, srcs):
    # caps of 1..3 tokens: most sentences end by the forced </s>, one (cap 1) with no step run at all
    for b in (1, 2, 3):
        kw = dict(max_len_a=0.0, max_len_b=b)
        ref = one_by_one(Translator(model_dir, **kw, **BATCH_PATH), srcs)
        assert max(map(len, ref)) == b - 1
        assert one_by_one(Translator(model_dir, **kw), srcs) == ref


@pytest.fixture(scope="module")
def shortlisted(model_dir, tmp_path_factory):
    """A copy of the model dir with a random shortlist: 25 candidates per source token, 20 frequent."""
    d = str(tmp_path_factory.mktemp("batch1-shortlist") / "model")
    shutil.copytree(model_dir, d)
    V = modeldir.read_config(d).arch.vocab_size
    g = torch.Generator().manual_seed(6)
    lists = [torch.randperm(V, generator=g)[:25].tolist() for _ in range(V)]
    offsets = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    modeldir.write_shortlist(d, offsets, torch.tensor(lists).view(-1), torch.arange(4, 24))
    return d


@pytest.mark.parametrize("settings", [dict(no_repeat_ngram=2), dict(shortlist=True),
                                      dict(shortlist=True, no_repeat_ngram=2, precision="int8")],
                         ids=["ngram", "shortlist", "shortlist+ngram+int8"])
def test_one_row_greedy_with_ngram_blocking_or_shortlist_gives_the_batch_tokens(shortlisted, srcs, settings):
    settings = {"precision": "fp32", **settings}
    ref = one_by_one(Translator(shortlisted, **settings, **BATCH_PATH), srcs)
    assert one_by_one(Translator(shortlisted, **settings), srcs) == ref


def test_one_row_state_runs_only_for_one_greedy_sentence(model_dir, srcs, monkeypatch):
    seen = []
    run = OneRowCache.run
    monkeypatch.setattr(OneRowCache, "run", lambda self, tok, t: (seen.append(type(tok)), run(self, tok, t))[1])
    Translator(model_dir, precision="fp32").translate_ids(srcs[:1])
    assert seen and set(seen) == {int}
    seen.clear()
    Translator(model_dir, precision="fp32").translate_ids(srcs[:2])
    Translator(model_dir, precision="fp32", beam=2).translate_ids(srcs[:1])
    Translator(model_dir, precision="fp32", one_row=False).translate_ids(srcs[:1])
    assert seen == []


@pytest.mark.skipif(not os.path.exists(os.path.join(TRAINED, "config.json")),
                    reason="trained fixture tests/fixtures/bible-tiny is absent (tests/fixtures/make_bible_tiny.sh)")
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_one_row_greedy_gives_the_batch_greedy_tokens_on_trained_model(precision):
    torch.set_num_threads(1)
    with open(TRAINED_SRC, encoding="utf-8") as fh:
        lines = [next(fh).rstrip("\n") for _ in range(60)]
    ref = Translator(TRAINED, precision=precision, **BATCH_PATH)
    srcs = ref.text.encode(lines)
    assert one_by_one(Translator(TRAINED, precision=precision), srcs) == one_by_one(ref, srcs)


def layer_calls(monkeypatch) -> list:
    """Records, per one-row step, whether it ran the C++ layer (OneRowCache.layers set)."""
    seen, run = [], OneRowCache.run
    monkeypatch.setattr(OneRowCache, "run", lambda self, tok, t: (seen.append(self.layers is not None),
                                                                  run(self, tok, t))[1])
    return seen


@pytest.mark.parametrize("kernel", [dict(int8_vnni_int_mm=False), dict(int8_vnni_int_mm=True)],
                         ids=["fbgemm", "int_mm-where-vnni"])
@pytest.mark.parametrize("settings", [dict(), dict(shortlist=True)], ids=["full", "shortlist"])
def test_one_row_layer_gives_the_layer_ops_tokens(shortlisted, srcs, kernel, settings, monkeypatch):
    # two decoder layers: the first layer's `nxt` norm is the second's norm1
    kw = dict(precision="int8", one_row_step=False, **kernel, **settings)
    ref = one_by_one(Translator(shortlisted, one_row_layer=False, **kw), srcs)
    seen = layer_calls(monkeypatch)
    assert one_by_one(Translator(shortlisted, one_row_layer=True, **kw), srcs) == ref
    assert seen and all(seen)


@pytest.mark.skipif(not os.path.exists(os.path.join(TRAINED, "config.json")), reason="trained fixture absent")
def test_one_row_layer_gives_the_layer_ops_tokens_on_the_trained_model(monkeypatch):
    with open(TRAINED_SRC, encoding="utf-8") as fh:
        lines = [next(fh).rstrip("\n") for _ in range(40)]
    one = lambda tr: [tr.translate([x])[0] for x in lines]  # noqa: E731
    ref = one(Translator(TRAINED, precision="int8", one_row_layer=False))
    seen = layer_calls(monkeypatch)
    assert one(Translator(TRAINED, precision="int8", one_row_step=False)) == ref
    assert seen and all(seen)


def test_one_row_layer_is_not_used_where_it_does_not_apply(model_dir, srcs, monkeypatch):
    seen, steps = layer_calls(monkeypatch), step_calls(monkeypatch)
    one_by_one(Translator(model_dir, precision="fp32"), srcs[:3])  # no int8 gemv linears
    one_by_one(Translator(model_dir, precision="int8", int8_gemv=False), srcs[:3])
    assert seen and not any(seen)
    one_by_one(Translator(model_dir, precision="int8", no_repeat_ngram=2), srcs[:3])  # needs the logits
    one_by_one(Translator(model_dir, precision="int8", one_row_layer=False), srcs[:3])
    assert steps == []


def test_one_row_layer_refuses_a_weight_list_of_the_wrong_length():
    from decoder import ops
    if not ops.available():
        pytest.skip("C++ ops unavailable")
    x = torch.zeros(1, 1, 8)
    kc = torch.zeros(1, 2, 5, 4)
    with pytest.raises(RuntimeError, match="6 linears"):
        torch.ops.decoder_ops.one_row_layer(x, x, [x] * 29, kc, kc.clone(), kc, kc, 0, 0, 1e-5, True)


def step_calls(monkeypatch) -> list:
    """Records the token of every step run by the whole-step C++ op (switch one_row_step)."""
    seen, make = [], OneRowCache.step_argmax

    def spy(self, out):
        step = make(self, out)
        return None if step is None else lambda tok, t: (seen.append(tok), step(tok, t))[1]
    monkeypatch.setattr(OneRowCache, "step_argmax", spy)
    return seen


@pytest.mark.parametrize("kernel", [dict(int8_vnni_int_mm=False), dict(int8_vnni_int_mm=True)],
                         ids=["fbgemm", "int_mm-where-vnni"])
@pytest.mark.parametrize("settings", [dict(), dict(shortlist=True)], ids=["full", "shortlist"])
def test_one_row_step_gives_the_per_layer_ops_tokens(shortlisted, srcs, kernel, settings, monkeypatch):
    kw = dict(precision="int8", **kernel, **settings)
    ref = one_by_one(Translator(shortlisted, one_row_step=False, **kw), srcs)
    steps = step_calls(monkeypatch)
    assert one_by_one(Translator(shortlisted, one_row_step=True, **kw), srcs) == ref
    assert len(steps) >= len(srcs)


@pytest.mark.skipif(not os.path.exists(os.path.join(TRAINED, "config.json")), reason="trained fixture absent")
def test_one_row_step_gives_the_layer_ops_tokens_on_the_trained_model(monkeypatch):
    with open(TRAINED_SRC, encoding="utf-8") as fh:
        lines = [next(fh).rstrip("\n") for _ in range(40)]
    one = lambda tr: [tr.translate([x])[0] for x in lines]  # noqa: E731
    ref = one(Translator(TRAINED, precision="int8", one_row_layer=False, one_row_step=False))
    steps = step_calls(monkeypatch)
    assert one(Translator(TRAINED, precision="int8")) == ref
    assert len(steps) >= len(lines)


def test_one_row_step_refuses_a_token_outside_the_vocabulary_and_lists_of_the_wrong_length():
    from decoder import ops
    if not ops.available():
        pytest.skip("C++ ops unavailable")
    emb, pos, n = torch.zeros(10, 8), torch.zeros(12, 8), torch.ones(8)
    out = [torch.zeros(4, 64, dtype=torch.int8), torch.ones(4), torch.zeros(4, dtype=torch.int32)]
    step = lambda token, w, caches: torch.ops.decoder_ops.one_row_step(  # noqa: E731
        token, 1, 0, emb, pos, n, n, 1e-5, w, caches, out, None, 0, 1e-5, True)
    with pytest.raises(RuntimeError, match="token 10 outside"):
        step(10, [n] * 30, [pos] * 4)
    with pytest.raises(RuntimeError, match="30 weights and 4 caches per layer"):
        step(3, [n] * 29, [pos] * 4)
