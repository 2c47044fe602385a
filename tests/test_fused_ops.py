"""decoder/csrc fused ops: each kernel against its PyTorch reference, and its
torch.library registration (schema, fake tensor, dispatch) with opcheck."""
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

from decoder import fused, ops
from tools.bench_kernels import off_boundary  # the same values one element off 16 bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ ops could not be built here (no compiler?)")

# (atol, rtol) per input dtype: the kernels compute in fp32 and round once at the
# end, the references round after every op in low precision
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 2e-2), torch.float16: (5e-3, 5e-3)}
DTYPES = list(TOL)
SHAPES = [(1, 1, 1), (1, 1, 7), (3, 5, 37), (2, 1, 256), (64, 1, 512), (9, 3, 1000)]


def close(a, b, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_add_bias_residual_layernorm_matches_reference(dtype, shape, with_bias):
    g = torch.Generator().manual_seed(hash((shape, with_bias)) % 2**31)
    n = shape[-1]
    x, h = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    gamma, beta = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    r, y = torch.ops.decoder_ops.add_bias_residual_layernorm(x, h, bias, gamma, beta, 1e-5)
    # the reference in fp32: the kernel's own arithmetic, rounded once
    r_ref, y_ref = fused.add_bias_residual_layernorm_reference(
        x.float(), h.float(), None if bias is None else bias.float(), gamma.float(), beta.float(), 1e-5)
    assert r.dtype == y.dtype == dtype and r.shape == y.shape == x.shape
    close(r, r_ref.to(dtype), dtype)
    close(y, y_ref.to(dtype), dtype)
    # and the low-precision reference the decoder would run without the kernel
    _, y_lo = fused.add_bias_residual_layernorm_reference(x, h, bias, gamma, beta, 1e-5)
    close(y, y_lo, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,K,V,n", [(1, 1, 1, 1), (1, 1, 13, 2), (3, 4, 1001, 8), (1, 5, 8000, 10),
                                     (16, 4, 259, 8), (2, 3, 17, 51)])
def test_log_softmax_topk_matches_reference(dtype, S, K, V, n):
    g = torch.Generator().manual_seed(S * 1000 + V)
    logits = (torch.randn(S * K, V, generator=g) * 4).to(dtype)
    scores = -torch.rand(S * K, generator=g) * 10
    v, i = torch.ops.decoder_ops.log_softmax_topk(logits, scores, K, n)
    v_ref, i_ref = fused.log_softmax_topk_reference(logits, scores, K, n)
    assert v.shape == i.shape == (S, n) and v.dtype == torch.float32 and i.dtype == torch.int64
    torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
    assert (v[:, :-1] >= v[:, 1:]).all()  # sorted, best first
    # each index points at its value (ties, frequent in bf16, may pick other equal candidates)
    cand = (torch.log_softmax(logits.float(), -1) + scores[:, None]).view(S, K * V)
    torch.testing.assert_close(cand.gather(1, i), v, atol=1e-5, rtol=1e-5)
    assert all(len(set(r)) == n for r in i.tolist())  # no candidate twice
    if dtype == torch.float32:  # random fp32 values do not tie
        assert torch.equal(i, i_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,K,V,n", [(1, 1, 1, 1), (3, 4, 1001, 8), (1, 5, 8000, 10), (2, 3, 17, 51)])
def test_topk_over_log_probs_picks_what_add_and_topk_pick_bit_for_bit(dtype, S, K, V, n):
    # normalized=True: the rows are ATen's log-probs; lp + score is rounded once, as the plain path does
    g = torch.Generator().manual_seed(S * 1000 + V + 1)
    lp = torch.log_softmax(torch.randn(S * K, V, generator=g) * 4, -1).to(dtype)
    scores = -torch.rand(S * K, generator=g) * 10
    v, i = torch.ops.decoder_ops.log_softmax_topk(lp, scores, K, n, True)
    v_ref, i_ref = fused.log_softmax_topk_reference(lp, scores, K, n, normalized=True)
    assert torch.equal(v, v_ref)
    cand = (lp.float() + scores[:, None]).view(S, K * V)
    assert torch.equal(cand.gather(1, i), v)
    if dtype == torch.float32:  # low-precision log-probs tie often; then any of the equal ones is right
        assert torch.equal(i, i_ref)


def test_log_softmax_topk_breaks_ties_towards_the_lower_index():
    logits = torch.zeros(2, 3)  # every candidate equal
    v, i = torch.ops.decoder_ops.log_softmax_topk(logits, torch.zeros(2), 2, 4)
    assert i.tolist() == [[0, 1, 2, 3]]


@pytest.fixture
def kernels_unreachable(monkeypatch):
    """Every decoder_ops op replaced by one that fails the test: bad input must be refused
    in Python before a kernel runs (a C++ exception crashed the process on some builds)."""
    def make(name):
        def called(*args):
            raise AssertionError(f"the {name} kernel ran on bad input")
        return called
    for name in OP_NAMES:
        monkeypatch.setattr(torch.ops.decoder_ops, name, make(name))


OP_NAMES = ("add_bias_residual_layernorm", "log_softmax_topk", "ngram_block_", "decode_attention",
            "decode_attention_rows", "encoder_attention", "cross_arrange", "cross_attention",
            "argmax_rows", "linear_argmax", "int8_linear", "int8_linear_quantized", "int8_linear_prequantized",
            "int8_gemm_pack", "int8_gemm", "int8_gemv", "shortlist_candidates")


@pytest.mark.parametrize("bad", ["rows", "n", "scores"])
def test_log_softmax_topk_rejects_inconsistent_shapes(bad, kernels_unreachable):
    logits, scores, K, n = torch.zeros(6, 5), torch.zeros(6), 3, 4
    if bad == "rows":
        K = 4
    elif bad == "n":
        n = 16
    else:
        scores = torch.zeros(5)
    with pytest.raises(ValueError, match="log_softmax_topk"):
        fused.log_softmax_topk(logits, scores, K, n)


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_pass_opcheck(dtype):
    x, h = torch.randn(3, 1, 37).to(dtype), torch.randn(3, 1, 37).to(dtype)
    b, gm, bt = (torch.randn(37).to(dtype) for _ in range(3))
    _opcheck(torch.ops.decoder_ops.add_bias_residual_layernorm.default, (x, h, b, gm, bt, 1e-5))
    _opcheck(torch.ops.decoder_ops.add_bias_residual_layernorm.default, (x, h, None, gm, bt, 1e-5))
    _opcheck(torch.ops.decoder_ops.log_softmax_topk.default, (torch.randn(8, 1001).to(dtype), torch.randn(8), 4, 8))
    _opcheck(torch.ops.decoder_ops.log_softmax_topk.default,
             (torch.randn(8, 1001).to(dtype), torch.randn(8), 4, 8, True))


def test_int8_linear_passes_opcheck():
    from decoder.quant import Int8Linear
    lin = Int8Linear(torch.randn(13, 37), torch.randn(13))
    _opcheck(torch.ops.decoder_ops.int8_linear.default, (torch.randn(5, 37), lin.wq_t, lin.w_scale, lin.b, True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("with_vocab", [False, True])
def test_ngram_block_matches_reference(dtype, n, with_vocab):
    g = torch.Generator().manual_seed(n)
    R, V = 9, 11
    hist = torch.cat([torch.randint(0, V, (R, 4), generator=g).repeat(1, 3),  # period 4: repeats guaranteed
                      torch.randint(0, V, (R, 5), generator=g)], 1)
    hist[::2, -5:] = hist[::2, 3:8]  # ... in every other row the suffix also repeats
    vocab = torch.tensor([0, 2, 3, 5, 7, 8, 10]) if with_vocab else None
    C = V if vocab is None else vocab.numel()
    logits = torch.randn(R, C, generator=g).to(dtype)
    want = fused.ngram_block_reference(logits.clone(), hist, n, vocab)
    got = logits.clone()
    torch.ops.decoder_ops.ngram_block_(got, hist, n, vocab)
    assert torch.equal(got, want)
    assert bool(torch.isinf(want).any())  # the case is not vacuous


def test_ngram_block_bans_exactly_the_completing_tokens():
    hist = torch.tensor([[5, 6, 7, 5, 6]])  # last bigram prefix "6" -> after "6" came 7; trigram "5 6" -> 7
    for n, banned in ((2, {7}), (3, {7}), (4, set())):
        logits = torch.zeros(1, 10)
        torch.ops.decoder_ops.ngram_block_(logits, hist, n, None)
        assert set(torch.isinf(logits[0]).nonzero()[:, 0].tolist()) == banned


def test_ngram_block_passes_opcheck():
    hist = torch.randint(0, 6, (4, 10))
    _opcheck(torch.ops.decoder_ops.ngram_block_.default, (torch.randn(4, 6), hist, 2, None))
    _opcheck(torch.ops.decoder_ops.ngram_block_.default, (torch.randn(4, 3), hist, 3, torch.tensor([1, 2, 4])))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Q,T,D,masked", [(1, 1, 1, 1, 1, False), (3, 4, 1, 17, 64, False),
                                               (2, 4, 4, 23, 32, True), (5, 2, 1, 9, 7, True),
                                               (64, 8, 1, 40, 64, False)])
def test_decode_attention_matches_sdpa(dtype, B, H, Q, T, D, masked):
    g = torch.Generator().manual_seed(B * 100 + T)
    q = torch.randn(B, H, Q, D, generator=g).to(dtype)
    cache = torch.randn(2, B, H, T + 5, D, generator=g).to(dtype)
    k, v = cache[0, :, :, :T], cache[1, :, :, :T]  # a strided slice of a cache, as in the decoder
    mask = None
    if masked:
        lens = torch.randint(1, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lens[:, None])[:, None, None, :]
    got = torch.ops.decoder_ops.decode_attention(q, k, v, mask)
    want = fused.decode_attention_reference(q.float(), k.float(), v.float(), mask)
    assert got.dtype == dtype and got.shape == q.shape
    close(got, want.to(dtype), dtype)


def test_decode_attention_passes_opcheck():
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 11, 8), torch.randn(2, 4, 11, 8)
    mask = torch.tensor([[True] * 11, [True] * 6 + [False] * 5])[:, None, None, :]
    _opcheck(torch.ops.decoder_ops.decode_attention.default, (q, k, v, None))
    _opcheck(torch.ops.decoder_ops.decode_attention.default, (q, k, v, mask))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T", [(1, 1), (8, 13), (12, 40)])
def test_decode_attention_through_a_row_table_reads_the_named_rows(dtype, B, T):
    g = torch.Generator().manual_seed(B * 10 + T)
    q = torch.randn(B, 4, 1, 64, generator=g).to(dtype)
    cache = torch.randn(2, B, 4, T + 3, 64, generator=g).to(dtype)
    k, v = cache[0, :, :, :T], cache[1, :, :, :T]  # the live slice of a cache
    rows = torch.randint(0, B, (B, T), generator=g)
    got = torch.ops.decoder_ops.decode_attention_rows(q, k, v, rows)
    # the same rows moved into place, then plain attention: what the copying reorder gives
    moved = [torch.stack([t[rows[b, j], :, j] for j in range(T)], 1) for t in (k, v) for b in range(B)]
    km, vm = torch.stack(moved[:B]), torch.stack(moved[B:])
    close(got, fused.decode_attention_reference(q.float(), km.float(), vm.float()).to(dtype), dtype)
    close(fused.decode_attention_reference(q.float(), k.float(), v.float(), rows=rows).to(dtype), got, dtype)
    if B > 1:  # a table that is not the identity must matter
        assert not torch.allclose(got.float(), fused.decode_attention_reference(q.float(), k.float(), v.float()))


def test_decode_attention_rows_refuses_a_row_outside_the_cache(kernels_unreachable):
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match="outside the cache"):
        fused.decode_attention(q, k, k, rows=torch.tensor([[0, 1, 2, 0, 1], [1] * 5]))
    with pytest.raises(ValueError, match="outside the cache"):
        fused.decode_attention(q, k, k, rows=torch.full((2, 5), -1))


def _int8(*shape):
    return torch.randint(-127, 128, shape, dtype=torch.int8)


# (what, a call of a wrapper with arguments its kernel would refuse, the words of the refusal)
BAD_CALLS = [
    ("layernorm shapes", lambda: fused.add_bias_residual_layernorm(
        torch.ones(2, 8), torch.ones(2, 7), None, torch.ones(8), torch.ones(8), 1e-5), "add_bias_residual_layernorm"),
    ("ngram rows", lambda: fused.ngram_block_(torch.ones(2, 5), torch.ones(3, 4, dtype=torch.long), 2), "same rows"),
    ("attention batch", lambda: fused.decode_attention(torch.ones(2, 4, 1, 8), torch.ones(3, 4, 5, 8),
                                                       torch.ones(3, 4, 5, 8)), "decode_attention"),
    ("attention mask", lambda: fused.decode_attention(torch.ones(2, 4, 1, 8), torch.ones(2, 4, 5, 8),
                                                      torch.ones(2, 4, 5, 8), torch.ones(2, 1, 1, 4, dtype=torch.bool)),
     "mask must be bool"),
    ("cuda attention batch", lambda: fused.decode_attention_cuda(torch.ones(2, 4, 1, 8), torch.ones(3, 4, 5, 8),
                                                                 torch.ones(3, 4, 5, 8)), "decode_attention"),
    ("cuda attention mask", lambda: fused.decode_attention_cuda(
        torch.ones(2, 4, 1, 8), torch.ones(2, 4, 5, 8), torch.ones(2, 4, 5, 8), torch.ones(2, 1, 1, 5)),
     "mask must be bool"),
    ("rows shape", lambda: fused.decode_attention(torch.ones(2, 4, 1, 8), torch.ones(2, 4, 5, 8),
                                                  torch.ones(2, 4, 5, 8), rows=torch.zeros(2, 4, dtype=torch.long)),
     "rows must be long"),
    ("encoder heads", lambda: fused.encoder_attention(torch.ones(2, 3, 10), None, 4), "encoder_attention"),
    ("cross k v", lambda: fused.CrossAttention(torch.ones(2, 4, 5, 8), torch.ones(2, 4, 6, 8)), "cross_arrange"),
    ("argmax empty rows", lambda: fused.argmax_rows(torch.ones(3, 0)), "argmax_rows"),
    ("linear_argmax shapes", lambda: fused.linear_argmax(torch.ones(2, 4), torch.ones(5, 3)), "linear_argmax"),
    ("linear_argmax chunk", lambda: fused.linear_argmax(torch.ones(2, 4), torch.ones(5, 4), None, 0), "chunk"),
    ("int8 features", lambda: ops.int8_linear(torch.ones(2, 5), _int8(4, 3), torch.ones(3), None), "5 features"),
    ("int8 prequantized", lambda: ops.int8_linear_prequantized(_int8(2, 4), torch.ones(3), _int8(4, 3),
                                                               torch.ones(3), None), "one float scale per row"),
    ("gemm pack index", lambda: ops.int8_gemm_pack(_int8(70, 256), torch.tensor([0, 70])), "out of range"),
    ("gemm layout", lambda: ops.int8_gemm(_int8(3, 128), _int8(100), 70), "int8_gemm_pack's layout"),
    ("gemv padding", lambda: ops.int8_gemv(torch.ones(1, 200), _int8(4, 64), torch.ones(4),
                                           torch.zeros(4, dtype=torch.int32), None), "padded to a multiple of 64"),
]


@pytest.mark.parametrize("call,words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_wrappers_refuse_bad_arguments_before_the_kernel_runs(call, words, kernels_unreachable):
    with pytest.raises(ops.OpArgumentError, match=re.escape(words)) as e:
        call()
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)  # as the kernel's own error was


def test_kernels_own_checks_still_raise_without_crashing_the_process():
    """The C++ checks, the second line: in a child process, so that a crash (issue 30) fails
    this test instead of ending the run."""
    code = """if True:
        import torch
        from decoder import ops
        assert ops.available()
        o = torch.ops.decoder_ops
        q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 5, 8)
        calls = [lambda: o.log_softmax_topk(torch.zeros(6, 5), torch.zeros(6), 4, 4),
                 lambda: o.decode_attention_rows(q, k, k, torch.full((2, 5), 2)),
                 lambda: o.shortlist_candidates(torch.tensor([[3]]), torch.tensor([0, 1, 2]),
                                                torch.tensor([1, 1]), torch.tensor([0]))]
        for f in calls:
            try:
                f()
            except RuntimeError as e:
                print(str(e).splitlines()[0])
            else:
                print("no error")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and "rows are not a multiple of K=4" in lines[0], lines
    assert "outside the cache" in lines[1] and "source id 3 outside the vocabulary of 2" in lines[2], lines


def test_decode_attention_rows_passes_opcheck():
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 11, 8), torch.randn(3, 4, 11, 8)
    rows = torch.randint(0, 3, (3, 11))
    _opcheck(torch.ops.decoder_ops.decode_attention_rows.default, (q, k, v, rows))
    mask = torch.tensor([[True] * 11, [True] * 6 + [False] * 5, [True] + [False] * 10])[:, None, None, :]
    _opcheck(torch.ops.decoder_ops.decode_attention_rows.default, (q, k, v, rows, mask))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_through_a_row_table_and_a_mask_reads_only_the_named_unmasked_keys(dtype):
    # the fixed-shape beam state (decoder/state.py StaticCache): a table over the whole buffer, the
    # positions past the step masked; what is masked is never read, so NaN there changes nothing
    g = torch.Generator().manual_seed(21)
    B, H, T, D = 8, 4, 20, 64
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(2))
    rows = torch.randint(0, B, (B, T), generator=g)
    lens = torch.tensor([14, 1, 7, 13, 14, 2, 9, 11])
    mask = (torch.arange(T)[None] < lens[:, None])[:, None, None, :]
    poisoned = v.clone()
    poisoned[:, :, 14:] = float("nan")
    got = torch.ops.decoder_ops.decode_attention_rows(q, k, poisoned, rows, mask)
    close(got, fused.decode_attention_reference(q.float(), k.float(), v.float(), mask, rows).to(dtype), dtype)
    for b in range(B):  # the same as the table and the cache cut at the row's length
        n = int(lens[b])
        cut = torch.ops.decoder_ops.decode_attention_rows(q[b:b + 1], k[:, :, :n], v[:, :, :n], rows[b:b + 1, :n])
        close(got[b:b + 1], cut, dtype)


def test_cuda_entry_reads_a_row_table_through_its_kernel(monkeypatch):
    ran = []
    monkeypatch.setattr(torch.ops.decoder_ops, "decode_attention_rows", lambda *a: ran.append(a[3:]) or a[0])
    q, k = torch.zeros(4096, 8, 1, 64), torch.zeros(4096, 8, 5, 64)
    rows, mask = torch.zeros(4096, 5, dtype=torch.long), torch.ones(4096, 1, 1, 5, dtype=torch.bool)
    fused.decode_attention_cuda(q, k, k, mask, rows)
    assert len(ran) == 1 and ran[0][0] is rows and ran[0][1] is mask and len(ran[0]) == 2


def test_only_a_cpu_row_table_has_its_values_checked_on_the_host(monkeypatch):
    # a GPU table's check would wait for the GPU, which a captured graph cannot: its kernel clamps
    read, aminmax = [], torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: read.append(t.device.type) or aminmax(t))
    for device in ("meta", "cpu"):
        q, k = torch.zeros(2, 4, 1, 8, device=device), torch.zeros(3, 4, 5, 8, device=device)
        fused._check_attention(q, k, k, None, torch.zeros(2, 5, dtype=torch.long, device=device))
    assert read == ["cpu"]
    with pytest.raises(ValueError, match="on the cache's device"):
        fused._check_attention(q, k, k, None, torch.zeros(2, 5, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,H,D,masked", [(1, 1, 4, 64, False), (1, 1, 4, 64, True), (1, 31, 4, 64, False),
                                             (3, 17, 2, 7, True), (4, 40, 4, 64, True), (2, 130, 3, 20, True)])
def test_encoder_attention_matches_chunk_heads_sdpa_merge(dtype, B, S, H, D, masked):
    g = torch.Generator().manual_seed(B * 1000 + S)
    qkv = torch.randn(B, S, 3 * H * D, generator=g).to(dtype)
    mask = None
    if masked:  # right padding, one row unpadded
        lens = torch.randint(1, S + 1, (B,), generator=g)
        lens[0] = S
        mask = (torch.arange(S)[None] < lens[:, None])[:, None, None, :]
    got = torch.ops.decoder_ops.encoder_attention(qkv, mask, H)
    want = fused.encoder_attention_reference(qkv.float(), mask, H)
    assert got.dtype == dtype and got.shape == (B, S, H * D)
    close(got, want.to(dtype), dtype)


def test_encoder_attention_skips_keys_masked_anywhere_and_gives_what_sdpa_gives_where_all_are():
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, 9, 3 * 2 * 16, generator=g)
    mask = torch.rand(3, 1, 1, 9, generator=g) > 0.4  # holes, not only right padding
    mask[0] = True
    mask[2] = False
    got = torch.ops.decoder_ops.encoder_attention(qkv, mask, 2)
    want = fused.encoder_attention_reference(qkv, mask, 2)
    close(got[:2], want[:2], torch.float32)
    # a row with no key: zeros, as torch 2.13's SDPA gives on CPU (2.4's gives NaN)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_encoder_attention_wrapper_runs_the_op_at_every_size_and_thread_count(monkeypatch):
    # with -fopenmp the op splits its (row, head) pairs over the threads and beats SDPA on
    # two threads too (decoder/README.md), so nothing is left to SDPA on the CPU
    calls = []
    monkeypatch.setattr(torch.ops.decoder_ops, "encoder_attention", lambda *a: calls.append(a[0].shape) or 0)
    big, small = torch.randn(12, 128, 3 * 256), torch.randn(1, 31, 3 * 256)
    for threads in (2, 1):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        fused.encoder_attention(big, None, 4)
        fused.encoder_attention(small, None, 4)
    assert calls == [big.shape, small.shape] * 2


def test_encoder_attention_passes_opcheck():
    qkv = torch.randn(2, 11, 3 * 4 * 8)
    mask = torch.tensor([[True] * 11, [True] * 6 + [False] * 5])[:, None, None, :]
    _opcheck(torch.ops.decoder_ops.encoder_attention.default, (qkv, None, 4))
    _opcheck(torch.ops.decoder_ops.encoder_attention.default, (qkv, mask, 4))
    _opcheck(torch.ops.decoder_ops.encoder_attention.default, (qkv.bfloat16(), mask, 4))


needs_cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or not ops.cuda_available(),
    reason="needs a GPU and the CUDA kernels built by nvcc (decoder/csrc/fused_cuda.cu)")


def test_self_check_finds_the_cpu_kernels_agree():
    assert fused.self_check("cpu") == []


def test_self_check_names_each_kernel_that_disagrees():
    def planted(name, *a):
        out = getattr(torch.ops.decoder_ops, name)(*a)
        if name == "decode_attention":
            return out + 1e-2
        if name == "argmax_rows":
            return (out + 1) % a[0].shape[1]
        if name == "log_softmax_topk" and a[4:] == (True,):  # normalized: the indices, not the values, wrong
            return out[0], (out[1] + 1) % (a[2] * a[0].shape[1])  # still one of the K * V candidates
        return out
    assert fused.self_check("cpu", planted) == ["decode_attention", "log_softmax_topk", "argmax_rows"]


@pytest.mark.parametrize("planted", ["wrong", "raises"])
def test_self_check_refuses_a_row_table_kernel_wrong_or_failing(planted):
    # on CPU the CPU kernel stands in for CUDA's: a wrong answer or a launch the GPU refuses
    def call(name, *a):
        if name != "decode_attention_rows":
            return getattr(torch.ops.decoder_ops, name)(*a)
        if planted == "raises":
            raise RuntimeError("CUDA error: too many resources requested for launch")
        return torch.ops.decoder_ops.decode_attention_rows(*a) + 1e-2
    assert fused.self_check("cpu", call) == ["decode_attention_rows"]


@needs_cuda_kernels
def test_self_check_finds_the_cuda_kernels_agree():
    assert fused.self_check("cuda") == []


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_kernels_match_references(dtype):
    dev = "cuda"
    g = torch.Generator().manual_seed(3)
    x, h = (torch.randn(7, 3, 257, generator=g).to(dev, dtype) for _ in range(2))
    b, gm, bt = (torch.randn(257, generator=g).to(dev, dtype) for _ in range(3))
    r, y = torch.ops.decoder_ops.add_bias_residual_layernorm(x, h, b, gm, bt, 1e-5)
    r_ref, y_ref = fused.add_bias_residual_layernorm_reference(x.float(), h.float(), b.float(), gm.float(),
                                                               bt.float(), 1e-5)
    close(r, r_ref.to(dtype), dtype)
    close(y, y_ref.to(dtype), dtype)
    q = torch.randn(5, 4, 2, 64, generator=g).to(dev, dtype)
    cache = torch.randn(2, 5, 4, 40, 64, generator=g).to(dev, dtype)
    mask = (torch.arange(33)[None] < torch.tensor([33, 5, 20, 1, 30])[:, None])[:, None, None, :].to(dev)
    got = torch.ops.decoder_ops.decode_attention(q, cache[0, :, :, :33], cache[1, :, :, :33], mask)
    want = fused.decode_attention_reference(q.float(), cache[0, :, :, :33].float(), cache[1, :, :, :33].float(), mask)
    close(got, want.to(dtype), dtype)
    logits = (torch.randn(12, 1001, generator=g) * 4).to(dev, dtype)
    scores = (-torch.rand(12, generator=g) * 10).to(dev)
    v, i = torch.ops.decoder_ops.log_softmax_topk(logits, scores, 4, 8)
    v_ref, _ = fused.log_softmax_topk_reference(logits, scores, 4, 8)
    torch.testing.assert_close(v, v_ref, atol=1e-3, rtol=1e-3)
    hist = torch.randint(0, 11, (9, 4), generator=g).repeat(1, 3).to(dev)
    lg = torch.randn(9, 11, generator=g).to(dev, dtype)
    want = fused.ngram_block_reference(lg.clone(), hist, 3)
    torch.ops.decoder_ops.ngram_block_(lg, hist, 3, None)
    assert torch.equal(lg, want)
    lg = torch.randn(9, 8001, generator=g).to(dev, dtype)
    assert torch.equal(torch.ops.decoder_ops.argmax_rows(lg), lg.argmax(-1))
    lg[2, 7] = lg[2, 4000] = lg[2].max() + 1  # a tie: the first index, as torch.argmax
    assert torch.equal(torch.ops.decoder_ops.argmax_rows(lg), lg.argmax(-1))
    xs, w = torch.randn(9, 64, generator=g).to(dev, dtype), torch.randn(8001, 64, generator=g).to(dev, dtype)
    got = torch.ops.decoder_ops.linear_argmax(xs, w, None, 1024)
    full = torch.nn.functional.linear(xs.float(), w.float())
    torch.testing.assert_close(full.gather(1, got[:, None])[:, 0], full.max(-1).values, atol=0.05, rtol=0)


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("C", [8, 1024, 8000, 8001])
def test_cuda_argmax_gives_torchs_index_from_either_kernel(dtype, C):
    # rows a multiple of 16 bytes take the warp kernel (8, 1024, 8000), others the block kernel;
    # both keep torch.argmax's order: NaN first, then the larger value, then the lower index
    g = torch.Generator().manual_seed(C)
    lg = torch.randn(3000, C, generator=g).to("cuda", dtype)
    lg[1, C // 3] = lg[1, C - 1] = lg[1].max() + 1  # a tie across lanes: the first index
    lg[2, C - 1] = float("nan")
    lg[3] = float("-inf")
    lg[4, 0] = lg[4, C // 2] = float("nan")  # two NaNs: the first
    want = lg.float().argmax(-1)
    want[2], want[4] = C - 1, 0  # the kit's order where NaNs are, whatever this torch's argmax says
    assert torch.equal(torch.ops.decoder_ops.argmax_rows(lg), want)
    off = off_boundary(lg)
    assert torch.equal(torch.ops.decoder_ops.argmax_rows(off), want)
    xs, w = torch.randn(300, 64, generator=g).to("cuda", dtype), torch.randn(C, 64, generator=g).to("cuda", dtype)
    full = torch.nn.functional.linear(xs, w).float()
    for chunk in (1024, 1001):  # chunks through the warp kernel; of 1,001 columns, through the block kernel
        got = torch.ops.decoder_ops.linear_argmax(xs, w, None, chunk)
        torch.testing.assert_close(full.gather(1, got[:, None])[:, 0], full.max(-1).values, atol=0.05, rtol=0)


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [8, 64, 512, 520, 1024, 1032])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cuda_residual_norm_gives_the_block_kernels_residual_bits_from_its_warp_kernel(dtype, n, with_bias):
    # aligned rows that fit a warp's registers take the warp kernel, rows off a 16-byte boundary the
    # block kernel: the same fp32 residual rounded once (the same bits), the same norm within rounding
    g = torch.Generator().manual_seed(n)
    rows = 1000
    x, h = (torch.randn(rows, n, generator=g).to("cuda", dtype) for _ in range(2))
    gamma, beta = (torch.randn(n, generator=g).to("cuda", dtype) for _ in range(2))
    bias = torch.randn(n, generator=g).to("cuda", dtype) if with_bias else None
    r, y = torch.ops.decoder_ops.add_bias_residual_layernorm(x, h, bias, gamma, beta, 1e-5)
    r_ref, y_ref = fused.add_bias_residual_layernorm_reference(
        x.float(), h.float(), None if bias is None else bias.float(), gamma.float(), beta.float(), 1e-5)
    close(r, r_ref.to(dtype), dtype)
    close(y, y_ref.to(dtype), dtype)
    r_block, y_block = torch.ops.decoder_ops.add_bias_residual_layernorm(off_boundary(x), h, bias, gamma, beta, 1e-5)
    assert torch.equal(r, r_block)
    close(y, y_block, dtype)


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_decode_attention_never_reads_the_value_of_a_masked_key(dtype):
    # the fixed-shape state masks its cache past the position: a step reads only what was written
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 1, 64, generator=g).to("cuda", dtype) if i == 0 else
               torch.randn(3, 2, 24, 64, generator=g).to("cuda", dtype) for i in range(3))
    mask = (torch.arange(24)[None] <= torch.tensor([0, 9, 23])[:, None])[:, None, None, :].cuda()  # (3, 1, 1, 24)
    poisoned = v.masked_fill(~mask.transpose(-1, -2), float("nan"))  # every masked key's value NaN
    got = torch.ops.decoder_ops.decode_attention(q, k, poisoned, mask)
    close(got, fused.decode_attention_reference(q.float(), k.float(), v.float(), mask).to(dtype), dtype)


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,Q,T,D", [(1, 1, 1, 1, 1), (3, 4, 1, 31, 16), (2, 8, 1, 33, 64), (5, 2, 4, 160, 40),
                                       (4096, 8, 1, 96, 64), (3, 2, 1, 800, 100), (2, 2, 1, 70, 128),
                                       (2, 2, 1, 9, 160), (2, 1, 1, 4000, 64)])
def test_cuda_decode_attention_matches_the_reference(dtype, B, H, Q, T, D):
    g = torch.Generator().manual_seed(B + T + D)
    q = torch.randn(B, H, Q, D, generator=g).to("cuda", dtype)
    cache = torch.randn(2, B, H, T + 5, D, generator=g).to("cuda", dtype)
    k, v = cache[0, :, :, :T], cache[1, :, :, :T]  # strided slices of a cache, as in the decoder
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None])[:, None, None, :].cuda()
    for m in (None, mask):
        got = torch.ops.decoder_ops.decode_attention(q, k, v, m)
        assert got.dtype == dtype and got.shape == q.shape
        close(got, fused.decode_attention_reference(q.float(), k.float(), v.float(), m).to(dtype), dtype)
        assert torch.equal(got, torch.ops.decoder_ops.decode_attention(q, k, v, m))  # deterministic


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,N,H,T,D", [(1, 1, 8, 1, 64), (3, 5, 4, 31, 16), (8, 8, 8, 96, 64), (40, 40, 2, 33, 40),
                                       (4096, 4096, 8, 96, 64), (2, 3, 2, 70, 128), (2, 2, 2, 9, 160)])
def test_cuda_decode_attention_through_a_row_table_matches_the_reference(dtype, B, N, H, T, D):
    g = torch.Generator().manual_seed(B + T + D)
    q = torch.randn(B, H, 1, D, generator=g).to("cuda", dtype)
    cache = torch.randn(2, N, H, T + 5, D, generator=g).to("cuda", dtype)
    k, v = cache[0, :, :, :T], cache[1, :, :, :T]  # strided slices of a cache, as in the decoder
    rows = torch.randint(0, N, (B, T), generator=g).cuda()
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None])[:, None, None, :].cuda()
    for m in (None, mask):
        want = fused.decode_attention_reference(q.float(), k.float(), v.float(), m, rows).to(dtype)
        got = torch.ops.decoder_ops.decode_attention_rows(q, k, v, rows, m)
        assert got.dtype == dtype and got.shape == q.shape
        close(got, want, dtype)
    if N == B > 1:  # a table that is not the identity must matter (against the rows as they are)
        assert not torch.allclose(got.float(), fused.decode_attention_reference(q.float(), k.float(), v.float(), m))


@needs_cuda_kernels
def test_cuda_row_table_entries_outside_the_cache_are_clamped_into_it():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(*s, generator=g).cuda().half() for s in ((4, 2, 1, 64), (4, 2, 12, 64), (4, 2, 12, 64)))
    rows = torch.randint(0, 4, (4, 12), generator=g)
    rows[0, 3], rows[2, 7], rows[3, 0] = -5, 4, 1 << 40
    got = torch.ops.decoder_ops.decode_attention_rows(q, k, v, rows.cuda(), None)
    torch.cuda.synchronize()  # no fault: the process goes on
    assert torch.equal(got, torch.ops.decoder_ops.decode_attention_rows(q, k, v, rows.clamp(0, 3).cuda(), None))


@needs_cuda_kernels
def test_cuda_decode_attention_passes_opcheck_and_gives_nan_where_every_key_is_masked():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(4, 2, 1, 64, generator=g).cuda().half()
    k, v = (torch.randn(4, 2, 40, 64, generator=g).cuda().half() for _ in range(2))
    mask = (torch.arange(40)[None] < torch.tensor([1, 17, 40, 0])[:, None])[:, None, None, :].cuda()
    poisoned = v.masked_fill(~mask.transpose(-1, -2), float("nan"))
    _opcheck(torch.ops.decoder_ops.decode_attention.default, (q, k, v, mask))
    got = torch.ops.decoder_ops.decode_attention(q, k, poisoned, mask)
    close(got[:3], fused.decode_attention_reference(q.float(), k.float(), v.float(), mask)[:3].half(), torch.float16)
    assert got[3].isnan().all()  # as SDPA gives


@needs_cuda_kernels
def test_a_beam_wider_than_the_cuda_top_k_kernel_takes_the_reference():
    # the kernel keeps at most 16 candidates; beam 9 asks for 18
    g = torch.Generator().manual_seed(5)
    logits, scores = torch.randn(18, 301, generator=g).cuda(), -torch.rand(18, generator=g).cuda()
    n = fused.CUDA_MAX_TOP + 2
    v, i = fused.log_softmax_topk(logits, scores, 9, n)
    v_ref, i_ref = fused.log_softmax_topk_reference(logits, scores, 9, n)
    torch.testing.assert_close(v, v_ref)
    assert torch.equal(i, i_ref)


# argmax: the same index as torch.argmax, whatever the dtype (no tolerance:
# both read the same stored values)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,C", [(1, 1), (1, 7), (3, 37), (64, 8000), (5, 8001), (0, 9)])
def test_argmax_rows_matches_torch_argmax(dtype, R, C):
    logits = torch.randn(R, C, generator=torch.Generator().manual_seed(R + C)).to(dtype)
    assert torch.equal(fused.argmax_rows(logits), logits.argmax(-1))


def test_argmax_rows_takes_the_first_of_ties_and_a_nan_over_numbers():
    logits = torch.tensor([[1., 5., 5., 2.], [float("-inf")] * 4, [0., float("nan"), 9., float("nan")],
                           [3., 2., 1., 3.]])
    assert torch.ops.decoder_ops.argmax_rows(logits).tolist() == logits.argmax(-1).tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,d,V,chunk", [(1, 1, 1, 1), (1, 16, 7, 3), (3, 37, 1001, 256), (64, 64, 8000, 1024),
                                         (9, 32, 50, 1000), (2, 8, 33, 32)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_argmax_picks_the_largest_logit(dtype, R, d, V, chunk, with_bias):
    g = torch.Generator().manual_seed(R * V + d)
    x, w = torch.randn(R, d, generator=g).to(dtype), torch.randn(V, d, generator=g).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if with_bias else None
    got = torch.ops.decoder_ops.linear_argmax(x, w, b, chunk)
    logits = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())  # (R, V)
    # a chunk's product may round differently from the full one: the pick must
    # be the reference's or within rounding of its logit
    assert got.shape == (R,) and got.dtype == torch.int64
    picked, best = logits.gather(1, got[:, None])[:, 0], logits.max(-1).values
    atol = {torch.float32: 1e-4, torch.bfloat16: 0.5, torch.float16: 0.05}[dtype]
    torch.testing.assert_close(picked, best, atol=atol, rtol=0)
    if dtype == torch.float32:
        assert torch.equal(got, fused.linear_argmax_reference(x, w, b))


def test_linear_argmax_keeps_the_first_index_across_chunks():
    x = torch.ones(2, 1)
    w = torch.tensor([[1.], [3.], [2.], [3.], [3.], [float("nan")]])  # ties in chunks 1 and 2, a NaN in 3
    assert torch.ops.decoder_ops.linear_argmax(x[:, :], w[:5], None, 2).tolist() == [1, 1]
    assert torch.ops.decoder_ops.linear_argmax(x, w, None, 2).tolist() == [5, 5]


def test_linear_argmax_keeps_an_exact_tie_when_the_last_chunk_is_narrow():
    # a 7-wide tail chunk once rounded differently from the full product and
    # picked row 8192 over its exact twin, row 0
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 512, generator=g), torch.randn(8199, 512, generator=g)
    w[0] = w[8192] = x[0] * 0.2
    got = torch.ops.decoder_ops.linear_argmax(x, w, None, 1024)
    assert got[0].item() == 0
    assert torch.equal(got, fused.linear_argmax_reference(x, w))


def test_linear_argmax_takes_a_bias_of_any_shape_with_v_elements():
    x, w, b = torch.randn(3, 8), torch.randn(50, 8), torch.randn(1, 50)
    assert torch.equal(torch.ops.decoder_ops.linear_argmax(x, w, b, 16), fused.linear_argmax_reference(x, w, b[0]))


def test_argmax_kernels_refuse_float64_and_the_wrappers_take_the_reference():
    # the kernels compare in fp32, where 1 and 1 + 1e-12 are equal
    logits = torch.tensor([[1.0, 1.0 + 1e-12]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="argmax_rows: float32, float16 or bfloat16 only"):
        torch.ops.decoder_ops.argmax_rows(logits)
    with pytest.raises(RuntimeError, match="linear_argmax: float32, float16 or bfloat16 only"):
        torch.ops.decoder_ops.linear_argmax(torch.ones(1, 1, dtype=torch.float64), logits.t().contiguous(), None, 8)
    assert fused.argmax_rows(logits).tolist() == [1]
    assert fused.linear_argmax(torch.ones(1, 1, dtype=torch.float64), logits.t().contiguous()).tolist() == [1]


def test_linear_argmax_rejects_mismatched_shapes():
    with pytest.raises(RuntimeError, match="linear_argmax"):
        torch.ops.decoder_ops.linear_argmax(torch.randn(2, 4), torch.randn(5, 3), None, 8)
    with pytest.raises(RuntimeError, match="chunk"):
        torch.ops.decoder_ops.linear_argmax(torch.randn(2, 4), torch.randn(5, 4), None, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ops_pass_opcheck(dtype):
    _opcheck(torch.ops.decoder_ops.argmax_rows.default, (torch.randn(5, 37).to(dtype),))
    x, w, b = torch.randn(5, 16).to(dtype), torch.randn(37, 16).to(dtype), torch.randn(37).to(dtype)
    _opcheck(torch.ops.decoder_ops.linear_argmax.default, (x, w, b, 8))
    _opcheck(torch.ops.decoder_ops.linear_argmax.default, (x, w, None, 64))


# the float loops are plain C++ left to the compiler (csrc/multiversion.h): this
# pins that each AVX2 / AVX-512 clone really holds packed vector code
VECTOR_LOOPS = ("residual_norm_row", "row_max", "row_sum_exp", "row_argmax",
                "attend_heads", "encoder_attend_heads", "quantize_row", "dequant_tile")  # attend_heads has dot, axpy, exp_shift_sum inlined


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("objdump"), reason="needs x86-64 and objdump")
def test_float_loops_are_vectorised_in_the_avx2_and_avx512_variants():
    with open("/proc/self/maps") as f:
        so = next((ln.split()[-1] for ln in f if ln.rstrip().endswith("decoder_ops.so")), None)
    if so is None:
        pytest.skip("decoder_ops.so is not a mapped file here")
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", so], capture_output=True, text=True,
                         check=True).stdout
    bodies = {}
    for block in re.split(r"\n(?=[0-9a-f]+ <)", dis):
        # MULTIVERSION's variants (csrc/multiversion.h): fn_v3 (x86-64-v3), fn_v4 (x86-64-v4)
        m = re.match(r"[0-9a-f]+ <(?:\(anonymous namespace\)::)?(\w+)_(v[34])\(", block)
        if m:
            bodies.setdefault((m.group(1), m.group(2)), block)
    packed = {"v3": r"\sv\w+p[sd]\s.*%ymm|\svp\w+\s.*%ymm",
              "v4": r"\sv\w+p[sd]\s.*%[yz]mm|\svp\w+\s.*%[yz]mm"}
    for fn in VECTOR_LOOPS:
        for clone, pattern in packed.items():
            assert (fn, clone) in bodies, f"{fn} has no {clone} variant (MULTIVERSION dropped?)"
            assert re.search(pattern, bodies[fn, clone]), f"{fn} [{clone}] has no packed vector instruction"


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_fused_ops_library_is_built_with_openmp_so_parallel_for_uses_torchs_threads():
    # without -fopenmp at::parallel_for compiles to a serial loop: every op ran on one
    # thread in a multi-threaded process (--threads N) whatever torch.set_num_threads said
    so = ops.build_library()
    symbols = subprocess.run(["nm", "-D", "--undefined-only", so], capture_output=True, text=True,
                             check=True).stdout
    assert "GOMP_parallel" in symbols


def test_int8_linear_quantized_and_prequantized_pass_opcheck():
    from decoder.quant import Int8Linear
    fc1, fc2 = Int8Linear(torch.randn(13, 37), torch.randn(13)), Int8Linear(torch.randn(7, 13), None)
    x = torch.randn(5, 37)
    _opcheck(torch.ops.decoder_ops.int8_linear_quantized.default, (x, fc1.wq_t, fc1.w_scale, fc1.b, True))
    q, s = torch.ops.decoder_ops.int8_linear_quantized(x, fc1.wq_t, fc1.w_scale, fc1.b, True)
    _opcheck(torch.ops.decoder_ops.int8_linear_prequantized.default, (q, s, fc2.wq_t, fc2.w_scale, None, False))
