"""Fused C++ ops (decoder/csrc) against their PyTorch references."""
import subprocess
import sys

import pytest
import torch

from decoder import ops
from decoder.quant import Int8Linear

needs_ops = pytest.mark.skipif(not ops.available(), reason="C++ ops could not be built here (no compiler?)")


def case(M, K, N, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(M, K, generator=g) * 3
    return Int8Linear(w, b), x, w, b


@needs_ops
@pytest.mark.parametrize("M,K,N", [(1, 64, 96), (7, 256, 768), (300, 128, 40), (2, 1024, 256)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("relu", [False, True])
def test_fused_int8_linear_matches_reference(M, K, N, bias, relu):
    lin, x, w, b = case(M, K, N, bias)
    ref = lin.reference(x)
    ref = ref.relu() if relu else ref
    got = ops.int8_linear(x, lin.wq_t, lin.w_scale, lin.b, relu)
    # same quantisation; only float rounding order (FMA) may differ
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    exact = torch.nn.functional.linear(x, w, b)
    exact = exact.relu() if relu else exact
    assert (got - exact).abs().max() < 0.03 * exact.abs().max()


@needs_ops
def test_int8_references_quantise_an_exact_half_as_the_kernels_do():
    """127 / amax once rounded (as the C++ kernels), not ATen's reciprocal times 127: for
    this row 0.01102262... * 127 / 2.7997455 is exactly 0.5 (-> 0 half to even), but
    0.50000006 with the reciprocal's extra rounding (-> 1): one quantisation step apart."""
    x = torch.tensor([[2.799745559692383, 0.01102262083441019] + [0.0] * 62])  # (1, 64)
    w = torch.eye(64)[:8] * 0.1  # output j = input j: the step shows in output 1
    lin = Int8Linear(w, None, gemv_rows=4)
    kernel = ops.int8_linear(x, lin.wq_t, lin.w_scale, None, False)
    assert kernel[0, 1] == 0.0
    assert torch.equal(lin.reference(x), kernel)
    assert torch.equal(lin.gemv.reference(x), lin.gemv(x))
    assert lin.gemv(x)[0, 1] == 0.0


@needs_ops
def test_fused_int8_linear_keeps_leading_dims():
    lin, x, _, _ = case(12, 64, 32)
    x3 = x.view(3, 4, 64)
    assert lin(x3).shape == (3, 4, 32)
    assert torch.equal(lin(x3).view(12, 32), lin(x))


@needs_ops
def test_fused_int8_linear_passes_opcheck():
    lin, x, _, _ = case(5, 64, 48)
    torch.library.opcheck(torch.ops.decoder_ops.int8_linear.default, (x, lin.wq_t, lin.w_scale, lin.b, True))


def test_decoder_runs_without_cpp_ops(tmp_path):
    """DECODER_NO_CPP_OPS (or no compiler) falls back to the PyTorch reference."""
    code = ("import sys; sys.path.insert(0, 'tests'); from decoder import ops; assert not ops.available(); "
            "from fixture_model import make_model_dir; from decoder import Translator; "
            f"d = make_model_dir({str(tmp_path / 'm')!r}, enc=1, dec=1); "
            "print(len(Translator(d, precision='int8').translate(['the dog', ''])))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "DECODER_NO_CPP_OPS": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2"


def test_memory_retention_is_idempotent():
    from decoder.runtime import retain_freed_memory
    first = retain_freed_memory()
    assert retain_freed_memory() == first
    if sys.platform.startswith("linux"):
        assert first  # glibc
