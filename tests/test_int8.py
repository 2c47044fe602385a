"""int8 through fbgemm's prepacked dynamic linear (decoder/quant.py FbgemmLinear),
the per-machine choice of it or our `_int_mm` linear (switch `int8_vnni_int_mm`),
the `auto` probe that picks int8 or fp32 per shape, and the container turning on
what the model dir has (submission/container/serve.py)."""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from decoder import Translator, modeldir, ops, quant
from decoder.quant import FbgemmLinear, Int8Linear
from fixture_model import make_model_dir

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
TRAINED, SRC, REF = (os.path.join(HERE, p) for p in ("model", "test.en", "test.es"))
trained = pytest.mark.skipif(not all(os.path.exists(p) for p in (os.path.join(TRAINED, "config.json"), SRC, REF)),
                             reason="trained fixture tests/fixtures/bible-tiny is absent")
fbgemm = pytest.mark.skipif(not quant.fbgemm_available(), reason="no fbgemm in this torch build (not x86)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model_dir(tmp_path_factory.mktemp("fixture") / "model", seed=1)


@fbgemm
@pytest.mark.parametrize("rows,k,n", [(1, 256, 8000), (64, 256, 768), (5, 1024, 256)])
def test_fbgemm_linear_is_close_to_fp32(rows, k, n):
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    ref = F.linear(x, w, b)
    lin = FbgemmLinear(w, b)
    # 8-bit weights and (7 or) 8-bit activations: error well under 2% of the output's range
    assert (lin(x) - ref).abs().max() < 0.02 * ref.abs().max()
    assert torch.equal(lin(x, relu=True), lin(x).relu())
    assert torch.allclose(lin.mm(x) + b, lin(x), atol=1e-4)
    assert lin(x.view(rows, 1, k)).shape == (rows, 1, n)


@fbgemm
def test_fbgemm_sliced_projection_equals_those_columns_of_the_full_one():
    g = torch.Generator().manual_seed(1)
    lin, x = FbgemmLinear(torch.randn(8000, 256, generator=g) * 0.05, None), torch.randn(3, 256, generator=g)
    idx = torch.tensor([0, 7, 100, 4095, 7999])
    assert torch.equal(lin.rows(idx, batch_rows=64)(x), lin(x)[:, idx])


@fbgemm
def test_fbgemm_sliced_projection_of_one_sentence_is_its_int8_rows_in_fp32():
    """Repacking costs more than one sentence's steps save: below REPACK_ROWS the
    slice is the same int8 weights, dequantised, run in fp32."""
    g = torch.Generator().manual_seed(1)
    lin, x = FbgemmLinear(torch.randn(8000, 256, generator=g) * 0.05, None), torch.randn(1, 256, generator=g)
    idx = torch.tensor([0, 7, 100, 4095, 7999])
    small = lin.rows(idx, batch_rows=1)
    assert isinstance(small, quant.Linear)
    assert torch.allclose(small(x), F.linear(x, lin.wq[idx].float() * lin.w_scale[idx, None]))
    assert (small(x) - lin(x)[:, idx]).abs().max() < 0.05 * lin(x).abs().max()


ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def machine(monkeypatch, vnni: bool, **caps):
    """A CPU with or without avx512_vnni, and these ISA caps in the environment."""
    monkeypatch.setattr(quant, "_cpu_has_vnni", lambda: vnni)
    for k in ISA_CAPS:
        monkeypatch.delenv(k, raising=False)
    for k, v in caps.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("caps,fast", [
    ({}, True), ({"ATEN_CPU_CAPABILITY": "avx512"}, True), ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, True),
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"}, True), ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, False), ({"ATEN_CPU_CAPABILITY": "default"}, False),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False), ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}, False), ({"DNNL_MAX_CPU_ISA": "SSE41"}, False),
    ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, False)])
def test_int_mm_counts_as_vnni_only_with_the_cpu_flag_and_no_isa_cap_below_it(monkeypatch, caps, fast):
    machine(monkeypatch, True, **caps)
    assert quant.int_mm_vnni() is fast
    machine(monkeypatch, False, **caps)
    assert quant.int_mm_vnni() is False


@fbgemm
@pytest.mark.parametrize("vnni,caps,kernel", [
    (True, {}, Int8Linear), (False, {}, FbgemmLinear),
    (True, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, FbgemmLinear),
    (True, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, FbgemmLinear)])
def test_int8_linears_run_int_mm_on_vnni_cpus_and_fbgemm_elsewhere(model_dir, monkeypatch, vnni, caps, kernel):
    """fbgemm_int8 and int8_vnni_int_mm on (the defaults): `_int_mm` beats fbgemm
    only where oneDNN runs VNNI; without it (or capped) it is 13-30x slower than fp32."""
    machine(monkeypatch, vnni, **caps)
    tr = Translator(model_dir, precision="int8")
    assert tr.plan.int8_kernel == ("int_mm" if kernel is Int8Linear else "fbgemm")
    layers = [tr.model.out_proj, tr.model.dec_layers[0].ffn.fc1, tr.model.enc_layers[0].attn.qkv]
    assert all(type(lin) is kernel for lin in layers)
    # the few-row kernel stays in whichever linear runs
    assert all(lin.gemv is not None for lin in layers) or not ops.available()


@fbgemm
def test_int8_vnni_int_mm_off_leaves_what_cpus_without_vnni_run(model_dir, monkeypatch):
    """Off on a VNNI CPU: fbgemm with the gemv kernel, the plan of a CPU without
    VNNI; fbgemm_int8 off: `_int_mm` everywhere, whatever the CPU."""
    from decoder.optimisations import Switches, resolve
    machine(monkeypatch, True)
    off = Translator(model_dir, precision="int8", int8_vnni_int_mm=False)
    assert type(off.model.out_proj) is FbgemmLinear and type(off.model.dec_layers[0].ffn.fc1) is FbgemmLinear
    assert off.model.out_proj.gemv is not None or not ops.available()
    assert off.translate(["the dog runs", "a cat"]) and off.plan.int8_kernel == "fbgemm"
    machine(monkeypatch, False)
    assert off.plan == resolve(Switches(), no_repeat_ngram=0, has_shortlist=False)
    assert type(Translator(model_dir, precision="int8", fbgemm_int8=False).model.out_proj) is Int8Linear


KERNELS = {"fbgemm": {"int8_vnni_int_mm": False}, "int_mm": {"fbgemm_int8": False}}


@fbgemm
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("beam", [1, 3])
def test_int8_shortlist_of_every_id_gives_the_full_vocabulary_tokens(model_dir, tmp_path, beam, kernel):
    d = str(tmp_path / "model")
    shutil.copytree(model_dir, d)
    V = modeldir.read_config(d).arch.vocab_size
    modeldir.write_shortlist(d, torch.arange(V + 1) * V, torch.arange(V).repeat(V), torch.tensor([], dtype=torch.long))
    # >= REPACK_ROWS sentences: fbgemm's slice is repacked int8 (one sentence's is fp32, tested above);
    # _int_mm's is a column slice, with the gemv kernel's rows for the batch's last few rows
    lines = ["the dog runs", "a cat", "hello world again and again", "dog", "the cat sees the dog",
             "world", "again the dog", "a hello", "cat and dog"]
    kw = dict(precision="int8", beam=beam, **KERNELS[kernel])
    full = Translator(d, **kw).translate(lines)
    assert Translator(d, shortlist=True, **kw).translate(lines) == full


@trained
@fbgemm
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_int8_greedy_of_each_kernel_is_within_bleu_bound_of_fp32_on_trained_model(kernel):
    import sacrebleu
    src = [ln.rstrip("\n") for ln in open(SRC, encoding="utf-8")][:150]
    ref = [ln.rstrip("\n") for ln in open(REF, encoding="utf-8")][:150]
    fp32 = Translator(TRAINED, precision="fp32").translate(src)
    tr = Translator(TRAINED, precision="int8", **KERNELS[kernel])
    assert type(tr.model.out_proj) is {"fbgemm": FbgemmLinear, "int_mm": Int8Linear}[kernel]
    hyps = tr.translate(src)
    bleu = lambda h: sacrebleu.corpus_bleu(h, [ref]).score  # noqa: E731
    assert bleu(hyps) >= bleu(fp32) - 0.2
    # most lines unchanged: 99/150 measured with 8-bit activations (fbgemm on an AVX-512 VNNI EPYC),
    # 72/150 with fbgemm's 7-bit ones where there is no VNNI (an AVX2 EPYC), 114/150 with `_int_mm`'s
    share = 0.4 if kernel == "fbgemm" and tr.model.out_proj.reduce_range else 0.5
    assert sum(a == b for a, b in zip(hyps, fp32)) >= share * len(src)


# -- the default precision ----------------------------------------------------------------------

@pytest.mark.parametrize("fbgemm,vnni,want", [(True, False, "int8"), (False, True, "int8"), (False, False, "fp32")])
def test_auto_and_no_precision_are_the_cpus_default_decided_by_its_int8_kernels(monkeypatch, fbgemm, vnni, want):
    from decoder import translator
    monkeypatch.setattr(translator, "fbgemm_available", lambda: fbgemm)
    monkeypatch.setattr(translator, "int_mm_vnni", lambda: vnni)
    for asked in (None, "auto"):
        assert translator.resolve_device_precision("cpu", asked) == ("cpu", want)
    assert translator.resolve_device_precision("cpu", "fp32") == ("cpu", "fp32")  # asked for: as asked


@pytest.mark.parametrize("vnni,bits", [(True, "8-bit activations"), (False, "7-bit activations (no VNNI)")])
def test_settings_line_says_how_many_bits_fbgemms_activations_have(model_dir, monkeypatch, vnni, bits):
    from decoder.runtime import describe
    if not quant.fbgemm_available():
        pytest.skip("no fbgemm in this torch build")
    monkeypatch.setattr(quant, "fbgemm_vnni", lambda: vnni)
    tr = Translator(model_dir, precision="int8", int8_vnni_int_mm=False)
    assert type(tr.model.out_proj) is FbgemmLinear and tr.model.out_proj.reduce_range is not vnni
    assert f", int8 by fbgemm, {bits}; " in describe(tr, "int8")


# -- the container --------------------------------------------------------------------------------

@pytest.mark.parametrize("hardware,task", [("CPU-1", "latency"), ("CPU-ALL", "throughput")])
def test_container_turns_on_the_model_dirs_shortlist(model_dir, tmp_path, monkeypatch, hardware, task):
    from submission.container import serve
    d = str(tmp_path / "model")
    shutil.copytree(model_dir, d)
    assert serve.settings(hardware, d, task)["shortlist"] is False
    V = modeldir.read_config(d).arch.vocab_size
    modeldir.write_shortlist(d, torch.arange(V + 1), torch.arange(V), torch.tensor([], dtype=torch.long))
    s = serve.settings(hardware, d, task)
    assert s["shortlist"] is True and s["precision"] is None  # the CPU's default
    tr = Translator(d, **{**s, "workers": 0})
    assert tr.shortlist is not None
    if task == "latency":
        assert (s["max_sentences"], s["workers"]) == (1, 0)


def test_container_leaves_a_listed_but_missing_shortlist_off(model_dir, tmp_path):
    """The image copied config.json (listing the file) without the file: the
    container must not turn the switch on and fail to load."""
    from submission.container import serve
    d = str(tmp_path / "model")
    shutil.copytree(model_dir, d)
    V = modeldir.read_config(d).arch.vocab_size
    modeldir.write_shortlist(d, torch.arange(V + 1), torch.arange(V), torch.tensor([], dtype=torch.long))
    os.remove(os.path.join(d, modeldir.read_config(d).shortlist))
    assert serve.settings("CPU-1", d, "latency")["shortlist"] is False


cpp_ops = pytest.mark.skipif(not ops.available(), reason="the C++ ops could not be built here")


@cpp_ops
@pytest.mark.parametrize("rows", [1, 5, 37, 300])
def test_int8_fc1_quantising_its_own_output_gives_fc2_the_same_bits(rows):
    g = torch.Generator().manual_seed(rows)
    fc1 = Int8Linear(torch.randn(96, 32, generator=g) * 0.1, torch.randn(96, generator=g))
    fc2 = Int8Linear(torch.randn(32, 96, generator=g) * 0.1, torch.randn(32, generator=g))
    x = torch.randn(rows, 1, 32, generator=g)
    h = fc1.quantized(x, relu=True)
    assert h.q.dtype == torch.int8 and h.q.shape == (rows, 1, 96) and h.s.shape == (rows, 1)
    assert torch.equal(fc2.mm(h), fc2.mm(fc1(x, relu=True)))
    assert torch.equal(fc2(h), fc2(fc1(x, relu=True)))
    assert torch.equal(fc2(fc1.quantized(x)), fc2(fc1(x)))  # no relu: negative outputs kept


@cpp_ops
@pytest.mark.parametrize("kernel", ["int_mm"])
def test_greedy_and_beam_tokens_equal_with_int8_quantized_hidden_on_and_off(model_dir, kernel):
    lines = ["a b c d e", "f g", "h i j k l m n o p", "q"] * 4
    for beam in (1, 4):
        on, off = (Translator(model_dir, precision="int8", beam=beam, int8_quantized_hidden=v, **KERNELS[kernel])
                   for v in (True, False))
        assert on.plan.hidden is not off.plan.hidden
        assert on.translate(lines) == off.translate(lines)


@trained
def test_int8_quantized_hidden_keeps_the_trained_models_tokens():
    with open(SRC, encoding="utf-8") as fh:
        lines = fh.read().splitlines()[:150]
    on, off = (Translator(TRAINED, precision="int8", int8_quantized_hidden=v, **KERNELS["int_mm"])
               for v in (True, False))
    assert on.translate(lines) == off.translate(lines)
