"""Beam search's output projection, log-softmax and top-k from the product's tiles
(decoder/csrc/project_topk.cpp, switch `fused_project_topk`): the reference's picks,
ties broken by the documented rule, the plain path where the kernel does not apply."""
import os

import pytest
import torch

from decoder import Translator, fused, ops
from decoder.optimisations import Kernels, Switches, resolve
from decoder.quant import Int8Linear

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
MODEL, SRC, REF = (os.path.join(HERE, p) for p in ("model", "test.en", "test.es"))
vnni = pytest.mark.skipif(not ops.int8_gemm_available(), reason="no AVX-512 VNNI (or no C++ ops) here")


def layer(N, d, g, bias=False, idx=None):
    """An Int8Linear on the packed product (the shortlist's slice of it where idx (C,) is given)."""
    w = torch.randn(N, d, generator=g) * 0.05
    lin = Int8Linear(w, torch.randn(N, generator=g) if bias else None, packed=True)
    return lin if idx is None else lin.rows(idx, batch_rows=64)


def beam_scores(S, K, g, first_step=False):
    scores = -torch.rand(S, K, generator=g) * 10  # (S, K) summed log-probs
    if first_step:
        scores[:, 1:] = float("-inf")  # the beam's first step: one live hypothesis a sentence
    return scores.view(-1)


def run(lin, x, scores, K, n):
    return fused.int8_linear_topk(x, lin.wq_t, lin.w_scale, lin.b, lin.packed, scores, K, n)


def reference(lin, x, scores, K, n):
    return fused.int8_linear_topk_reference(x, lin.wq_t, lin.w_scale, lin.b, scores, K, n)


@vnni
@pytest.mark.parametrize("S,K,N,d,bias", [(1, 4, 301, 64, False), (3, 4, 1000, 256, True), (5, 2, 64, 36, False),
                                          (40, 4, 4450, 256, False), (7, 1, 130, 17, True), (2, 4, 3, 8, False)])
@pytest.mark.parametrize("first_step", [False, True])
def test_kernel_picks_the_references_ids_and_scores_on_random_shapes(S, K, N, d, bias, first_step):
    g = torch.Generator().manual_seed(S * 31 + N + d)
    lin, x = layer(N, d, g, bias), torch.randn(S * K, d, generator=g)
    scores = beam_scores(S, K, g, first_step)
    n = min(2 * K, K * N)  # N=3: fewer columns than 2K, each row keeps all it has
    (v, i), (rv, ri) = run(lin, x, scores, K, n), reference(lin, x, scores, K, n)
    assert i.dtype == torch.long and v.shape == i.shape == (S, n)
    finite = rv > float("-inf")  # among -inf candidates (dead beams) the order is the kernel's own
    assert torch.equal(i[finite], ri[finite])
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)


@vnni
def test_shortlist_slice_gives_the_references_picks():
    g = torch.Generator().manual_seed(5)
    idx = torch.sort(torch.randperm(3000, generator=g)[:700]).values  # (C,) ascending, as a shortlist's
    lin, x = layer(3000, 128, g, idx=idx), torch.randn(12 * 4, 128, generator=g)
    assert lin.packed is not None  # sliced and packed again, per batch
    scores = beam_scores(12, 4, g)
    (v, i), (rv, ri) = run(lin, x, scores, 4, 8), reference(lin, x, scores, 4, 8)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)


@vnni
def test_ties_go_to_the_lower_row_then_the_lower_column():
    # columns 7, 100 and 250 the same weights and a large bias: the same logit in every row, and
    # every sentence's best; rows 0 and 1 of each sentence the same input and the best score: the
    # same candidates in both. The rule: equal scores, the lower index (row * N + column) first,
    # as log_softmax_topk's and a stable sort's.
    g = torch.Generator().manual_seed(3)
    N, d, S, K = 300, 64, 3, 4
    w, b = torch.randn(N, d, generator=g) * 0.05, torch.zeros(N)
    w[100] = w[250] = w[7]
    b[[7, 100, 250]] = 10.0
    lin = Int8Linear(w, b, packed=True)
    x = torch.randn(S, K, d, generator=g)
    x[:, 1] = x[:, 0]
    scores = torch.tensor([0.0, 0.0, -5.0, -6.0]).repeat(S)  # (S*K,)
    v, i = run(lin, x.view(S * K, d), scores, K, 2 * K)
    full = torch.log_softmax(Int8Linear(w, b).reference(x.view(S * K, d)), -1) + scores[:, None]  # (S*K, N)
    want = torch.sort(full.view(S, K * N), dim=1, descending=True, stable=True).indices[:, :2 * K]
    tied = [k * N + c for k in (0, 1) for c in (7, 100, 250)]
    assert i[:, :6].tolist() == [tied] * S  # the ties are really there, in index order
    assert torch.equal(i, want)
    torch.testing.assert_close(v, full.view(S, K * N).gather(1, want), rtol=1e-5, atol=1e-5)


@vnni
def test_without_packed_weights_it_is_the_reference():
    g = torch.Generator().manual_seed(9)
    lin, x = layer(200, 32, g), torch.randn(8, 32, generator=g)
    scores = beam_scores(2, 4, g)
    got = fused.int8_linear_topk(x, lin.wq_t, lin.w_scale, None, None, scores, 4, 8)
    want = reference(lin, x, scores, 4, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@vnni
@pytest.mark.parametrize("case,words", [
    (dict(K=3), "rows are not a multiple of K=3"),
    (dict(scores=torch.zeros(5)), "one float32 score per row"),
    (dict(n=0), "n must be in [1, K*N"),
    (dict(n=4 * 200 + 1), "n must be in [1, K*N"),
    (dict(packed=torch.zeros(10, dtype=torch.int8)), "not int8_gemm_pack's layout"),
    (dict(x=torch.zeros(8, 31)), "wq_t must be int8 (31, 200)"),
])
def test_bad_arguments_are_refused_in_python_before_the_kernel(case, words):
    g = torch.Generator().manual_seed(1)
    lin = layer(200, 32, g)
    a = dict(x=torch.randn(8, 32, generator=g), packed=lin.packed, scores=torch.zeros(8), K=4, n=8)
    a.update(case)
    with pytest.raises(ops.OpArgumentError, match=__import__("re").escape(words)):
        fused.int8_linear_topk(a["x"], lin.wq_t, lin.w_scale, None, a["packed"], a["scores"], a["K"], a["n"])


@vnni
def test_op_passes_opcheck():
    g = torch.Generator().manual_seed(2)
    lin = layer(130, 40, g, bias=True)
    args = (torch.randn(8, 40, generator=g), lin.packed, lin.w_scale, lin.b, 130, torch.zeros(8), 4, 8)
    torch.library.opcheck(torch.ops.decoder_ops.int8_linear_topk, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_the_plan_leaves_it_off_with_ngram_blocking_and_without_the_cpp_ops():
    on, switch = Kernels(cpu=True, cuda=False), Switches(fused_project_topk=True)
    want = ops.int8_gemm_available()  # it needs the packed product, which needs VNNI
    assert resolve(switch, beam=4, kernels=on).project_topk == want
    assert resolve(Switches(), beam=4, kernels=on).project_topk == want  # on by default (the KD student: 1.05x)
    assert not resolve(switch, beam=4, kernels=on, no_repeat_ngram=3).project_topk  # needs the whole row
    assert not resolve(switch, beam=4, kernels=Kernels(cpu=False, cuda=False)).project_topk
    assert not resolve(switch, beam=4, kernels=on, device="cuda").project_topk


@vnni
@pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "config.json")), reason="trained fixture is absent")
def test_only_the_packed_int8_output_layer_has_the_fused_path():
    int8 = Translator(MODEL, precision="int8", beam=4, fused_project_topk=True).model
    d = int8.d
    assert int8.topk_projection(None, 40) is not None
    assert int8.topk_projection(None, 4) is None  # the gemv kernel's few rows: the plain path
    assert int8.topk_projection(None, int8.out_proj.PACKED_ROWS + 1) is None  # _int_mm above the packed rows
    assert int8.topk_projection(int8.output_rows(torch.arange(0, 2000, 3), 40), 40) is not None  # a shortlist
    fp32 = Translator(MODEL, precision="fp32", beam=4, fused_project_topk=True).model
    assert fp32.topk_projection(None, 40) is None
    y = torch.randn(40, d, generator=torch.Generator().manual_seed(0))
    v, i = int8.topk_projection(None, 40)(y, torch.zeros(40), 4, 8)
    want = fused.log_softmax_topk_reference(int8.project(y), torch.zeros(40), 4, 8)
    assert torch.equal(i, want.indices)


@vnni
@pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "config.json")), reason="trained fixture is absent")
def test_int8_beam4_with_the_fused_projection_topk_on_the_trained_model(monkeypatch):
    calls, op = [], fused.int8_linear_topk
    monkeypatch.setattr(fused, "int8_linear_topk", lambda *a: calls.append(1) or op(*a))
    torch.set_num_threads(2)
    with open(SRC, encoding="utf-8") as fh:
        src = [line.rstrip("\n") for line in fh][:150]
    plain = Translator(MODEL, precision="int8", beam=4, fused_project_topk=False).translate(src)
    assert not calls
    ours = Translator(MODEL, precision="int8", beam=4, fused_project_topk=True).translate(src)
    assert calls  # the op ran
    assert ours == plain
