"""GPU path (fp16 on CUDA); skipped without CUDA, except the GPU benchmark's
CPU fallback and its kernel classification."""
import pytest
import torch

from decoder import Translator
from fixture_model import make_model_dir, synthetic_corpus
from tools.naive import NaiveTranslator

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("gpu") / "model", seed=5)


@cuda
def test_cuda_fp32_greedy_equals_cpu(model_dir):
    lines = synthetic_corpus(30, seed=1)
    cpu = Translator(model_dir).translate(lines)
    gpu = Translator(model_dir, device="cuda", precision="fp32").translate(lines)
    same = sum(a == b for a, b in zip(cpu, gpu))
    assert same >= 0.9 * len(lines)  # TF32/kernel order may flip rare near-ties


@cuda
def test_cuda_runs_fp16_at_gpu_sized_batches_by_default(model_dir):
    from decoder.cliargs import GPU_MAX_SENTENCES, GPU_MAX_TOKENS
    tr = Translator(model_dir, device="cuda")
    assert (tr.precision, tr.opts.max_tokens, tr.opts.max_sentences) == ("fp16", GPU_MAX_TOKENS, GPU_MAX_SENTENCES)


@cuda
def test_cuda_fp16_greedy_and_beam_keep_one_line_per_input(model_dir):
    lines = synthetic_corpus(30, seed=2) + ["", "the dog " * 800]
    for beam in (1, 4):
        tr = Translator(model_dir, device="cuda", precision="fp16", beam=beam)
        assert tr.device == "cuda" and len(tr.translate(lines)) == len(lines)


@cuda
def test_cuda_cache_equals_no_cache_in_fp32(model_dir):
    lines = synthetic_corpus(10, seed=3)
    a = Translator(model_dir, device="cuda", precision="fp32").translate(lines)
    b = NaiveTranslator(model_dir, device="cuda", precision="fp32").translate(lines)
    assert sum(x == y for x, y in zip(a, b)) >= 9


def default_and_variant(model_dir, lines, beam, **variant):
    """(the default fp16 decoder's outputs, `variant`'s, whether a capture of the default's failed)."""
    default = Translator(model_dir, device="cuda", precision="fp16", beam=beam)
    out = default.translate(lines)
    other = Translator(model_dir, device="cuda", precision="fp16", beam=beam, **variant).translate(lines)
    return out, other, default.model.graphs_failed


@cuda
@pytest.mark.parametrize("beam", [1, 4])
def test_cuda_graph_replay_equals_eager_steps(model_dir, beam):
    a, b, failed = default_and_variant(model_dir, synthetic_corpus(20, seed=4), beam, cuda_graphs=False,
                                       static_shapes=True)
    assert a == b and not failed  # same kernels, replayed instead of launched


@cuda
@pytest.mark.parametrize("beam", [1, 4])
def test_cuda_every_batch_of_a_run_is_captured_after_the_last_ones_graphs_are_freed(model_dir, beam):
    # batches past graph_reuse's 16 rows free their graphs; once a pool's last graph was freed,
    # the next capture into it failed (H200, torch 2.11: the allocators' use_count assert)
    lines = synthetic_corpus(300, seed=9)
    tr = Translator(model_dir, device="cuda", precision="fp16", beam=beam, max_sentences=32)
    first = tr.translate(lines)
    assert len(first) == len(lines) and tr.translate(lines) == first and not tr.model.graphs_failed


@cuda
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("switch", ["encode_ahead", "decode_ahead", "short_gil_interval", "graph_attention",
                                    "kv_row_table"])
def test_cuda_host_scheduling_switches_keep_the_tokens(model_dir, beam, switch):
    # many batches, over chunks (the text threads busy beside the decoding), graphs captured per batch
    from decoder.optimisations import BY_NAME
    lines = synthetic_corpus(240, seed=10)
    kw = dict(device="cuda", precision="fp16", beam=beam, max_sentences=32, chunk_lines=100)
    default = Translator(model_dir, **kw)
    flipped = Translator(model_dir, **kw, **{switch: not BY_NAME[switch].default})
    a, b = default.translate(lines), flipped.translate(lines)
    if switch == "graph_attention":
        # another attention kernel, products of other row counts or other encoder batches: fp16 sums in
        # another order may flip a near-tie
        assert sum(x == y for x, y in zip(a, b)) >= 0.9 * len(lines)
    else:  # the same kernels, queued in another order (kv_row_table: the same keys read through the table)
        assert a == b
    assert not default.model.graphs_failed and not flipped.model.graphs_failed


@cuda
@pytest.mark.parametrize("beam", [1, 4])
def test_cuda_batch1_replays_kept_graphs_with_the_tokens_of_fresh_ones(model_dir, beam):
    lines = synthetic_corpus(12, seed=7)
    tr = Translator(model_dir, device="cuda", precision="fp16", beam=beam, max_sentences=1)
    first, again = tr.translate(lines), tr.translate(lines)  # the second pass replays kept graphs
    fresh = Translator(model_dir, device="cuda", precision="fp16", beam=beam, max_sentences=1,
                       graph_reuse=False)
    assert first == again == fresh.translate(lines)
    assert not tr.model.graphs_failed and not fresh.model.graphs_failed


@pytest.mark.parametrize("name,tc", [
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_kernel__5x_cublas", True),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn", True),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", True),
    ("volta_sgemm_128x64_nn", False),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>", False)])
def test_gpu_bench_tells_tensor_core_gemms_by_name(name, tc):
    from tools.ablation_gpu import GEMM, TENSOR_CORE
    assert GEMM.search(name) and bool(TENSOR_CORE.search(name)) == tc


@pytest.mark.parametrize("cuda", [True, False])
def test_gpu_bench_rows_are_distinct_configurations_with_unnamed_fused_switches_off(cuda):
    # a row whose switch is already on by default would repeat the row before it
    from decoder.optimisations import kernels_off
    from tools import ablation_gpu as bench_gpu
    rows = bench_gpu.configurations(cuda)
    settings = [tuple(sorted(kw.items())) for _, kw in rows]
    # on CPU fp16 becomes fp32, so only the first two rows may coincide
    assert len(set(settings)) == len(settings) - (0 if cuda else 1)
    fused = list(kernels_off())
    for name, kw in rows:
        assert set(fused) <= set(kw), f"{name} leaves {sorted(set(fused) - set(kw))} to the defaults"


def test_gpu_bench_runs_its_rows_on_cpu_without_cuda(model_dir, tmp_path):
    """Every row and the profile table on CPU: the path a GPU run takes, minus CUDA."""
    from tools import ablation_gpu as bench_gpu
    src, ref = tmp_path / "t.en", tmp_path / "t.es"
    lines = synthetic_corpus(6, seed=3)
    src.write_text("\n".join(lines) + "\n")
    ref.write_text("\n".join(lines) + "\n")
    out = tmp_path / "gpu"
    assert bench_gpu.main(["--model", str(model_dir), "--src", str(src), "--ref", str(ref), "--passes", "1",
                           "--out", str(out)]) == 0
    import json
    rec = json.loads((tmp_path / "gpu.json").read_text())
    names = [r["configuration"] for r in rec["rows"]]
    assert len(names) == len(set(names)) == len(bench_gpu.configurations(torch.cuda.is_available()))
    assert all(r["words_per_s"] > 0 for r in rec["rows"])
    assert rec["gemm_kernels"], "the profile found no matmul"
    assert "| configuration |" in (tmp_path / "gpu.md").read_text()
