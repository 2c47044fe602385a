"""Our int8 product without VNNI (decoder/csrc/int8_gemm.cpp "Without VNNI", switch
`int8_wide_gemm`): the weights widened to int16 once, `vpmaddwd` on AVX2 (its plain loop
below AVX2): exactly `torch._int_mm`'s integers, so an AVX2 CPU decodes the tokens the VNNI
path decodes, and a shortlist's slice is a row gather, never a repack."""
import os

import pytest
import torch

from decoder import Translator, ops
from decoder.quant import FbgemmLinear, Int8Linear, QuantRows
from fixture_model import make_model_dir

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
TRAINED, SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")
trained = pytest.mark.skipif(not os.path.exists(os.path.join(TRAINED, "config.json")),
                             reason="trained fixture tests/fixtures/bible-tiny is absent")
pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ ops could not be built here (no compiler?)")
simd = pytest.mark.skipif(not ops.int8_gemm_wide_available(), reason="no AVX2 here (or capped below it)")


def _int8(shape, g):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)  # the whole range, -128 included


@pytest.mark.parametrize("M", [1, 2, 3, 17, 160])
@pytest.mark.parametrize("K,N", [(256, 4450), (1024, 256), (256, 37), (255, 70), (7, 5), (33, 1), (512, 2050)])
def test_wide_product_equals_int_mm_exactly(M, K, N):
    g = torch.Generator().manual_seed(M * 7 + N + K)
    w, x = _int8((N, K), g), _int8((M, K), g)
    w16 = ops.int8_gemm_widen(w)
    assert w16.dtype == torch.int16 and tuple(w16.shape) == ops.wide_shape(N, K)
    assert torch.equal(w16[:N, :K], w.short()) and not w16[N:].any() and not w16[:, K:].any()
    got = ops.int8_gemm(x, w16, N)
    assert got.dtype == torch.int32 and torch.equal(got, torch._int_mm(x, w.t()))


def test_wide_product_split_over_threads_equals_int_mm():
    g = torch.Generator().manual_seed(3)
    w, x = _int8((4450, 256), g), _int8((300, 256), g)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(ops.int8_gemm(x, ops.int8_gemm_widen(w), 4450), torch._int_mm(x, w.t()))
    finally:
        torch.set_num_threads(n)


def test_widened_weights_of_another_shape_are_refused():
    g = torch.Generator().manual_seed(0)
    w16 = ops.int8_gemm_widen(_int8((70, 256), g))
    with pytest.raises(RuntimeError, match="int8_gemm_widen's layout"):
        ops.int8_gemm(_int8((3, 128), g), w16, 70)
    with pytest.raises(RuntimeError, match="int8_gemm_widen's layout"):  # the kernel's own check, second line
        torch.ops.decoder_ops.int8_gemm(_int8((3, 128), g), w16, 70)


def _pair(N, K, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g) if bias else None
    on, off = Int8Linear(w, b, wide=True), Int8Linear(w, b)
    assert on.packed is not None and on.packed.dtype == torch.int16 and off.packed is None
    return on, off, g


@simd
@pytest.mark.parametrize("N,K", [(768, 256), (4450, 256), (256, 1024), (37, 255)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_outputs_are_bit_equal_with_widened_weights_at_every_row_count(N, K, bias):
    on, off, g = _pair(N, K, bias)
    for rows in (5, 40, 1500):  # the encoder's batches too: without VNNI _int_mm is a plain loop
        x = torch.randn(rows, 1, K, generator=g)
        assert on._packed(x.numel()) is not None
        assert torch.equal(on(x), off(x)) and on(x).shape == (rows, 1, N)
    assert torch.equal(on(x, relu=True), off(x, relu=True)) and torch.equal(on.mm(x), off.mm(x))
    q_on, q_off = on.quantized(x, relu=True), off.quantized(x, relu=True)
    assert torch.equal(q_on.q, q_off.q) and torch.equal(q_on.s, q_off.s)
    nxt_on, nxt_off, _ = _pair(13, N, bias, seed=1)
    assert torch.equal(nxt_on(QuantRows(*q_on)), nxt_off(QuantRows(*q_off)))


@simd
@pytest.mark.parametrize("C", [37, 4450])
def test_shortlist_slice_is_a_row_gather_of_the_widened_weights_and_equals_those_columns(C, monkeypatch):
    on, off, g = _pair(8000, 256, True)
    monkeypatch.setattr(ops, "int8_gemm_pack", None)  # no packing per batch
    monkeypatch.setattr(ops, "int8_gemm_widen", None)
    idx = torch.randperm(8000, generator=g)[:C].sort().values
    s_on = on.rows(idx, batch_rows=40)
    assert torch.equal(s_on.packed[:C], on.packed[idx]) and s_on.packed.shape[0] == ops.wide_shape(C, 256)[0]
    for rows in (40, 300):
        x = torch.randn(rows, 256, generator=g)
        assert torch.equal(s_on(x), off.rows(idx, batch_rows=40)(x)) and torch.equal(s_on(x), off(x)[:, idx])


@simd
def test_switch_takes_the_wide_product_only_where_int_mm_has_no_vnni(monkeypatch, tmp_path):
    d = make_model_dir(tmp_path / "model", seed=1)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # as the AVX2-capped bench: _int_mm without VNNI
    on = Translator(d, precision="int8", int8_wide_gemm=True)
    assert on.plan.int8_kernel == "wide" and on.model.out_proj.packed.dtype == torch.int16
    off = Translator(d, precision="int8")  # off by default: fbgemm was faster (docs/bench/decoder.md)
    assert off.plan.int8_kernel == "fbgemm" and isinstance(off.model.out_proj, FbgemmLinear)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr("decoder.quant._cpu_has_vnni", lambda: True)  # a VNNI CPU: _int_mm (and packed) stay
    assert Translator(d, precision="int8", int8_wide_gemm=True).plan.int8_kernel == "int_mm"


@trained
@simd
@pytest.mark.parametrize("beam", [1, 4])
def test_tokens_on_trained_model_are_the_same_with_the_wide_product_as_with_int_mm(monkeypatch, beam):
    """The AVX2 pick (ATEN_CPU_CAPABILITY=avx2: our wide product, the shortlist-free projection
    and the encoder's batches included) against `_int_mm`'s integers: token for token."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    src = open(SRC).read().splitlines()[:60]
    on = Translator(TRAINED, precision="int8", beam=beam, int8_wide_gemm=True)
    assert on.plan.int8_kernel == "wide" and on.model.out_proj.packed.dtype == torch.int16
    off = Translator(TRAINED, precision="int8", beam=beam, fbgemm_int8=False, int8_wide_gemm=False,
                     int8_packed_gemm=False)
    assert off.model.out_proj.packed is None
    assert on.translate(src) == off.translate(src)


def with_shortlist(src_dir, tmp_path) -> str:
    """A copy of a model dir with a lexical shortlist of 60 ids a source token (seeded)."""
    import shutil
    from decoder import modeldir
    d = str(tmp_path / "sl-model")
    shutil.copytree(src_dir, d)
    V = modeldir.read_config(d).arch.vocab_size
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (V * 60,), generator=g)
    modeldir.write_shortlist(d, torch.arange(V + 1) * 60, ids, torch.arange(4, 40))
    return d


@simd
def test_wide_output_runs_beside_fbgemm_layers_only_without_vnni_and_with_a_shortlist(monkeypatch, tmp_path):
    d = with_shortlist(make_model_dir(tmp_path / "model", seed=1), tmp_path)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    on = Translator(d, precision="int8", shortlist=True, int8_wide_output=True)
    assert (on.plan.int8_kernel, on.plan.int8_out_kernel) == ("fbgemm", "wide")
    assert isinstance(on.model.enc_layers[0].ffn.fc1, FbgemmLinear)
    assert isinstance(on.model.out_proj, Int8Linear) and on.model.out_proj.packed.dtype == torch.int16
    # no shortlist: fbgemm's projection is packed once, nothing to save
    assert Translator(d, precision="int8", int8_wide_output=True).plan.int8_out_kernel is None
    assert Translator(d, precision="int8", shortlist=True).plan.int8_out_kernel is None  # off by default
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr("decoder.quant._cpu_has_vnni", lambda: True)  # VNNI: the packed product everywhere
    assert Translator(d, precision="int8", shortlist=True, int8_wide_output=True).plan.int8_out_kernel is None


@trained
@simd
@pytest.mark.parametrize("beam", [1, 4])
def test_wide_output_gives_the_tokens_of_int_mm_projection_beside_fbgemm_layers(monkeypatch, tmp_path, beam):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    d = with_shortlist(TRAINED, tmp_path)
    src = open(SRC).read().splitlines()[:60]
    on = Translator(d, precision="int8", beam=beam, shortlist=True, int8_wide_output=True)
    ref = Translator(d, precision="int8", beam=beam, shortlist=True, int8_wide_output=True)
    w = on.model.out_proj
    # the same integers and scales through _int_mm: its logits are the wide product's exactly
    ref.model.out_proj = Int8Linear(torch.zeros(w.out_features, w.wq_t.shape[0]), None, gemv_rows=4)
    ref.model.out_proj.wq_t, ref.model.out_proj.w_scale = w.wq_t, w.w_scale
    ref.model.out_proj.gemv = None if w.gemv is None else w.gemv
    assert ref.model.out_proj.packed is None
    assert on.translate(src) == ref.translate(src)


def test_wide_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    w = _int8((70, 37), g)
    opts = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.decoder_ops.int8_gemm_widen.default, (w,), test_utils=opts)
    torch.library.opcheck(torch.ops.decoder_ops.int8_gemm.default, (_int8((5, 37), g), ops.int8_gemm_widen(w), 70),
                          test_utils=opts)
    lin = Int8Linear(torch.randn(13, 37), torch.randn(13), wide=True)
    torch.library.opcheck(torch.ops.decoder_ops.int8_linear.default,
                          (torch.randn(5, 37), lin.wq_t, lin.w_scale, lin.b, True, lin.packed), test_utils=opts)
