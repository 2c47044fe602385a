"""Our int8 product on weights packed once for AVX-512 VNNI (decoder/csrc/int8_gemm.cpp,
switch `int8_packed_gemm`): exactly `torch._int_mm`'s integers, so every Int8Linear
output and every token stays the same with it on."""
import os

import pytest
import torch

from decoder import Translator, ops
from decoder.quant import Int8Linear, QuantRows
from fixture_model import make_model_dir

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
TRAINED, SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")
trained = pytest.mark.skipif(not os.path.exists(os.path.join(TRAINED, "config.json")),
                             reason="trained fixture tests/fixtures/bible-tiny is absent")
pytestmark = pytest.mark.skipif(not ops.int8_gemm_available(), reason="no AVX-512 VNNI (or no C++ ops) here")
INT_MM = {"fbgemm_int8": False}  # our Int8Linear wherever fbgemm would otherwise run


def _int8(shape, g):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)  # the whole range, -128 included


@pytest.mark.parametrize("M", [1, 3, 17, 40, 160, 1500])
@pytest.mark.parametrize("K,N", [(256, 4450), (1024, 256), (256, 37), (255, 70), (7, 5)])
def test_packed_product_equals_int_mm_exactly(M, K, N):
    g = torch.Generator().manual_seed(M * 7 + N)
    w, x = _int8((N, K), g), _int8((M, K), g)
    got = ops.int8_gemm(x, ops.int8_gemm_pack(w), N)
    assert got.dtype == torch.int32 and torch.equal(got, torch._int_mm(x, w.t()))


@pytest.mark.parametrize("K", [256, 255])
def test_packed_rows_of_a_gather_equal_the_pack_of_the_gathered_rows(K):
    g = torch.Generator().manual_seed(K)
    w = _int8((300, K), g)
    idx = torch.randperm(300, generator=g)[:77]
    assert torch.equal(ops.int8_gemm_pack(w, idx), ops.int8_gemm_pack(w[idx]))
    x = _int8((9, K), g)
    assert torch.equal(ops.int8_gemm(x, ops.int8_gemm_pack(w, idx), 77), torch._int_mm(x, w[idx].t()))


def test_packed_weights_of_another_shape_are_refused():
    g = torch.Generator().manual_seed(0)
    packed = ops.int8_gemm_pack(_int8((70, 256), g))
    with pytest.raises(RuntimeError, match="int8_gemm_pack's layout"):
        ops.int8_gemm(_int8((3, 128), g), packed, 70)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.int8_gemm_pack(_int8((70, 256), g), torch.tensor([0, 70]))


def _pair(N, K, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g) if bias else None
    on, off = Int8Linear(w, b, packed=True), Int8Linear(w, b)
    assert on.packed is not None and off.packed is None
    return on, off, g


@pytest.mark.parametrize("N,K", [(768, 256), (4450, 256), (256, 1024), (37, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_outputs_are_bit_equal_with_packed_weights(N, K, bias):
    on, off, g = _pair(N, K, bias)
    rows = 40
    x = torch.randn(rows, 1, K, generator=g)
    assert on._packed(x.numel()) is not None
    assert torch.equal(on(x), off(x)) and on(x).shape == (rows, 1, N)
    assert torch.equal(on(x, relu=True), off(x, relu=True))
    assert torch.equal(on.mm(x), off.mm(x))
    assert torch.equal(on(x), off.reference(x))
    q_on, q_off = on.quantized(x, relu=True), off.quantized(x, relu=True)
    assert torch.equal(q_on.q, q_off.q) and torch.equal(q_on.s, q_off.s)
    nxt_on, nxt_off, _ = _pair(13, N, bias, seed=1)
    assert torch.equal(nxt_on(QuantRows(*q_on)), nxt_off(QuantRows(*q_off)))
    assert torch.equal(nxt_on.mm(QuantRows(*q_on)), nxt_off.mm(QuantRows(*q_off)))


def test_int8_linear_takes_int_mm_above_its_packed_rows():
    on, off, g = _pair(768, 256, True)
    x = torch.randn(on.packed_rows + 1, 256, generator=g)
    assert on._packed(x.numel()) is None and on._packed(x.numel() - 256) is not None
    assert torch.equal(on(x), off(x))


@pytest.mark.parametrize("C", [37, 4450])
def test_shortlist_slice_is_packed_per_batch_and_equals_those_columns(C):
    on, off, g = _pair(8000, 256, True)
    idx = torch.randperm(8000, generator=g)[:C].sort().values
    s_on, s_off = on.rows(idx, batch_rows=40), off.rows(idx, batch_rows=40)
    assert s_on.packed is not None and s_off.packed is None
    x = torch.randn(40, 256, generator=g)
    assert torch.equal(s_on(x), s_off(x)) and torch.equal(s_on(x), off(x)[:, idx])
    # a batch of more rows a step than the slice's packed product takes: not packed at all
    assert on.rows(idx, batch_rows=Int8Linear.PACKED_ROWS + 1).packed is None


def test_switch_packs_only_where_int_mm_runs_vnni(monkeypatch, tmp_path):
    d = make_model_dir(tmp_path / "model", seed=1)
    on = Translator(d, precision="int8", **INT_MM)
    assert on.plan.int8_packed_gemm and on.model.out_proj.packed is not None
    off = Translator(d, precision="int8", int8_packed_gemm=False, **INT_MM)
    assert not off.plan.int8_packed_gemm and off.model.out_proj.packed is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # capped: _int_mm's plain path, not ours
    assert not Translator(d, precision="int8", **INT_MM).plan.int8_packed_gemm


@trained
@pytest.mark.parametrize("beam", [1, 4])
def test_tokens_on_trained_model_are_the_same_with_packed_weights(monkeypatch, beam):
    """Every Int8Linear call above the gemv rows takes the packed product (its rows gate
    opened: the encoder's batches too)."""
    monkeypatch.setattr(Int8Linear, "PACKED_ROWS", 1 << 20)
    src = open(SRC).read().splitlines()[:60]
    calls = []
    real = ops.int8_gemm_pack
    monkeypatch.setattr(ops, "int8_gemm_pack", lambda *a: calls.append(1) or real(*a))
    on = Translator(TRAINED, precision="int8", beam=beam, **INT_MM)
    off = Translator(TRAINED, precision="int8", beam=beam, int8_packed_gemm=False, **INT_MM)
    assert calls and on.model.out_proj._packed(256 * 128) is not None
    assert on.translate(src) == off.translate(src)


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_packed_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    w = _int8((70, 37), g)
    _opcheck(torch.ops.decoder_ops.int8_gemm_pack.default, (w,))
    _opcheck(torch.ops.decoder_ops.int8_gemm_pack.default, (w, torch.tensor([3, 0, 69])))
    _opcheck(torch.ops.decoder_ops.int8_gemm.default, (_int8((5, 37), g), ops.int8_gemm_pack(w), 70))
    fc1, fc2 = Int8Linear(torch.randn(13, 37), torch.randn(13), packed=True), Int8Linear(torch.randn(7, 13), None,
                                                                                         packed=True)
    x = torch.randn(5, 37)
    _opcheck(torch.ops.decoder_ops.int8_linear.default, (x, fc1.wq_t, fc1.w_scale, fc1.b, True, fc1.packed))
    _opcheck(torch.ops.decoder_ops.int8_linear_quantized.default, (x, fc1.wq_t, fc1.w_scale, fc1.b, True, fc1.packed))
    q, s = torch.ops.decoder_ops.int8_linear_quantized(x, fc1.wq_t, fc1.w_scale, fc1.b, True, fc1.packed)
    _opcheck(torch.ops.decoder_ops.int8_linear_prequantized.default,
             (q, s, fc2.wq_t, fc2.w_scale, None, False, fc2.packed))


def test_packed_product_split_over_threads_equals_int_mm():
    g = torch.Generator().manual_seed(3)
    w, x = _int8((4450, 256), g), _int8((1500, 256), g)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        packed = ops.int8_gemm_pack(w)
        assert torch.equal(ops.int8_gemm(x, packed, 4450), torch._int_mm(x, w.t()))
        assert torch.equal(ops.int8_gemm(x[:40], packed, 4450), torch._int_mm(x[:40], w.t()))
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("M,K,N", [(200, 1024, 100), (97, 256, 768), (1, 40, 3)])
def test_the_epilogue_from_the_tiles_gives_the_bits_of_the_stored_product(M, K, N):
    """On packed weights int8_linear dequantises each task's tile (96 rows of a 64-column panel)
    from a scratch that stays in cache, the int32 product never stored: across tasks, k blocks
    and threads, the bits of `_int_mm`'s product dequantised."""
    g = torch.Generator().manual_seed(M + K + N)
    w, x = _int8((N, K), g), torch.randn(M, K, generator=g)
    ws, b = torch.rand(N, generator=g) * 0.01 + 1e-3, torch.randn(N, generator=g)
    packed, n = ops.int8_gemm_pack(w), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for bias in (b, None):
            for relu in (False, True):
                args = (x, w.t().contiguous(), ws, bias, relu)
                assert torch.equal(torch.ops.decoder_ops.int8_linear(*args, packed),
                                   torch.ops.decoder_ops.int8_linear(*args, None))
    finally:
        torch.set_num_threads(n)
