"""tools/bench_kernels.py without a GPU: its inputs are the decoder's shapes, the copies that pick
fused_cuda.cu's older kernels are the same values off a 16-byte boundary, the table is measured
from the ops it is given, and it refuses a machine without the CUDA kernels in one line."""
import pytest
import torch

from decoder import ops
from tools import bench_kernels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_off_boundary_copy_holds_the_same_values_one_element_past_16_bytes(dtype):
    t = torch.randn(33, 64).to(dtype)
    off = bench_kernels.off_boundary(t)
    assert torch.equal(off, t) and off.is_contiguous() and off.dtype == dtype
    assert off.data_ptr() % 16 == t.element_size() and t.data_ptr() % 16 == 0


def test_cases_are_the_decoders_shapes_and_aligned():
    got = bench_kernels.cases(300, "cpu")
    assert len(got) == 2
    for op, args in got.values():
        assert all(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))
    x, h, b, gm, bt, eps = list(got.values())[0][1]
    assert x.shape == h.shape == (300, 512) and b.shape == gm.shape == bt.shape == (512,) and eps == 1e-5
    assert list(got.values())[1][1][0].shape == (300, 1024)


def test_shifting_moves_the_floating_inputs_and_keeps_masks_and_numbers():
    x, mask = torch.randn(4, 64, dtype=torch.float16), torch.ones(4, 1, 1, 5, dtype=torch.bool)
    sx, smask, seps = bench_kernels.shifted([x, mask, 1e-5])
    assert sx.data_ptr() % 16 != 0 and torch.equal(sx, x)
    assert smask is mask and seps == 1e-5


@pytest.mark.skipif(not ops.available(), reason="the C++ ops could not be built here (no compiler?)")
def test_each_row_times_the_op_on_both_inputs_and_compares_their_outputs(monkeypatch):
    # the CPU kernels stand in for CUDA's: one kernel either way, the same outputs
    g = torch.Generator().manual_seed(0)
    x, h, b, gm, bt = (torch.randn(*s, generator=g) for s in ((50, 512), (50, 512), (512,), (512,), (512,)))
    calls = []

    def norm(*a):
        calls.append(a[0].data_ptr() % 16 == 0)
        return torch.ops.decoder_ops.add_bias_residual_layernorm(*a)
    monkeypatch.setattr(bench_kernels, "cases", lambda rows, device: {"norm": (norm, [x, h, b, gm, bt, 1e-5])})
    (row,) = bench_kernels.measure(50, 4, "cpu")
    assert calls.count(True) == calls.count(False) == 3 + 4 + 1  # warm-ups, timed calls, the comparison
    assert row["op"] == "norm" and row["rows"] == 50 and row["wide_ms"] > 0 and row["old_ms"] > 0
    # the speedup comes from the unrounded times: it lies within what the rounded ones allow
    e = 5e-5
    low, high = (row["old_ms"] - e) / (row["wide_ms"] + e), (row["old_ms"] + e) / (row["wide_ms"] - e)
    assert low - 0.005 <= row["speedup"] <= high + 0.005 and row["max_diff"] == 0.0
    md = bench_kernels.to_markdown([row], "head")
    assert md.startswith("head\n") and md.count("\n| norm | 50 |") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_a_machine_without_the_cuda_kernels_in_one_line(capsys):
    assert bench_kernels.main(["--rows", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "GPU" in err[0]
