"""Lexical shortlist: the builder's pairs, the file's validation, and decoding over it."""
import importlib
import itertools
import json
import os
import shutil
import tracemalloc

import numpy as np
import pytest
import torch

from conftest import toy_parallel
from decoder import Translator, modeldir, ops
from decoder.modeldir import ModelDirError
from decoder.shortlist import Shortlist, candidates_kernel
from fixture_model import make_model_dir, synthetic_corpus
from student.data import read_lines
from student.shortlist import add_to_model_dir, build, cooc, encode_corpus
from tools.naive import NaiveTranslator
from tools.synth_corpus import generate

build_mod = importlib.import_module("student.shortlist.build")  # the package's `build` is the function


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model_dir(tmp_path_factory.mktemp("fixture") / "model", seed=1)


@pytest.fixture(scope="module")
def vocab(base_dir):
    return modeldir.read_config(base_dir).arch.vocab_size


@pytest.fixture(scope="module")
def lines():
    return synthetic_corpus(30, seed=7)


def copy_with(base_dir, tmp_path, lists, frequent=()):
    """A copy of the fixture model dir whose shortlist gives source token s the ids lists[s]."""
    d = str(tmp_path / "model")
    shutil.copytree(base_dir, d)
    offsets = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    ids = torch.tensor([t for x in lists for t in x], dtype=torch.long)
    modeldir.write_shortlist(d, offsets, ids, torch.tensor(frequent, dtype=torch.long))
    return d


# -- decoding -------------------------------------------------------------------------------

@pytest.mark.parametrize("switches", [
    dict(beam=1), dict(beam=3), dict(beam=1, precision="int8"), dict(beam=3, precision="int8"),
    dict(beam=1, static_shapes=True), dict(beam=2, naive=True, early_stop=False),
    dict(beam=1, fused_project_argmax=False), dict(beam=3, fused_topk=False)],
    ids=["greedy", "beam", "greedy-int8", "beam-int8", "greedy-static", "beam-recompute", "greedy-plain-projection",
         "beam-plain-topk"])
def test_whole_vocabulary_shortlist_gives_the_same_output(base_dir, tmp_path, vocab, lines, switches):
    d = copy_with(base_dir, tmp_path, [list(range(vocab))] * vocab)
    switches = {"precision": "fp32", **switches}
    make = NaiveTranslator if switches.pop("naive", False) else Translator  # tools/naive.py: no K/V cache
    full = make(d, shortlist=False, **switches).translate(lines)
    assert make(d, shortlist=True, **switches).translate(lines) == full


def test_shortlist_with_only_eos_and_one_token_produces_that_token(base_dir, tmp_path, vocab, lines):
    tr = Translator(base_dir, precision="fp32")
    x = tr.text.sp.piece_to_id("▁house")
    assert x > 3
    d = copy_with(base_dir, tmp_path, [[x]] * vocab)
    for beam in (1, 3):
        out = Translator(d, precision="fp32", shortlist=True, beam=beam).translate_ids(tr.text.encode(lines))
        assert {t for o in out for t in o} == {x}, f"beam {beam}"


def test_shortlist_decoding_equals_full_decoding_with_the_others_masked(base_dir, tmp_path, vocab, lines):
    # a real-looking shortlist: token s may produce ids s-20..s+20 and 10 frequent ones
    lists = [[t for t in range(s - 20, s + 21) if 0 <= t < vocab] for s in range(vocab)]
    d = copy_with(base_dir, tmp_path, lists, frequent=list(range(4, 14)))
    tr = Translator(d, precision="fp32", shortlist=True)
    srcs = tr.text.encode(lines)
    S = max(map(len, srcs))
    src = torch.tensor([s + [1] * (S - len(s)) for s in srcs])
    allowed = tr.shortlist.candidates(src)
    assert allowed.numel() < vocab and 2 in allowed.tolist()
    ref = Translator(d, precision="fp32", shortlist=False)
    full_proj = ref.model.out_proj
    mask = torch.full((vocab,), float("-inf"))
    mask[allowed] = 0

    class Masked:  # the full output layer, then everything outside the shortlist at -inf
        def __call__(self, x, relu=False):
            return full_proj(x) + mask
    ref.model.out_proj = Masked()
    out = tr.translate_ids(srcs)
    assert out == ref.translate_ids(srcs)
    assert set(t for o in out for t in o) <= set(allowed.tolist())


def test_candidates_are_the_union_of_source_lists_frequent_and_eos(base_dir, tmp_path, vocab):
    lists = [[] for _ in range(vocab)]
    lists[10], lists[11] = [40, 30], [30, 50]
    d = copy_with(base_dir, tmp_path, lists, frequent=[7])
    tr = Translator(d, precision="fp32", shortlist=True)
    src = torch.tensor([[10, 11, 2], [11, 2, 1]])
    assert tr.shortlist.candidates(src).tolist() == [2, 7, 30, 40, 50]
    assert tr.shortlist.candidates_reference(src).tolist() == [2, 7, 30, 40, 50]


@pytest.mark.skipif(not ops.available(), reason="the C++ ops could not be built here (no compiler?)")
def test_candidates_kernel_equals_the_tensor_reference_on_random_lists():
    g = torch.Generator().manual_seed(3)
    V = 500
    for trial in range(20):
        n = torch.randint(0, 12, (V,), generator=g) * (torch.rand(V, generator=g) < 0.7)  # some empty lists
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)])
        ids = torch.randint(0, V, (int(offsets[-1]),), generator=g)  # duplicates within and across lists
        frequent = torch.randint(0, V, (trial,), generator=g)
        sl = Shortlist(offsets, ids, frequent, eos_id=2, device="cpu", candidates=candidates_kernel)
        src = torch.randint(0, V, (1 + trial % 4, 1 + trial), generator=g)
        assert torch.equal(sl.candidates(src), sl.candidates_reference(src)), trial


@pytest.mark.skipif(not ops.available(), reason="the C++ ops could not be built here (no compiler?)")
def test_candidates_kernel_refuses_ids_outside_the_vocabulary(monkeypatch):
    # refused in Python, before the kernel: its own C++ check crashed the process on some builds (issue 30)
    monkeypatch.setattr(torch.ops.decoder_ops, "shortlist_candidates", lambda *a: pytest.fail("the kernel ran"))
    none = torch.tensor([], dtype=torch.long)
    with pytest.raises(ValueError, match="target id 5 outside the vocabulary of 2"):
        Shortlist(torch.tensor([0, 1, 2]), torch.tensor([1, 5]), none, 0, "cpu")
    with pytest.raises(ValueError, match="always-allowed id 7 outside"):
        Shortlist(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), none, 7, "cpu")
    with pytest.raises(ValueError, match="offsets must ascend"):
        Shortlist(torch.tensor([0, 2, 1]), torch.tensor([1, 0]), none, 0, "cpu")
    sl = Shortlist(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), none, 0, "cpu", candidates=candidates_kernel)
    for bad in (3, -1):
        with pytest.raises(ValueError, match=f"source id {bad} outside the vocabulary of 2"):
            sl.candidates(torch.tensor([[1, bad]]))


def test_the_translator_binds_the_candidates_op_once_and_never_asks_again(base_dir, tmp_path, vocab, lines,
                                                                         monkeypatch):
    lists = [[(7 * s + j) % vocab for j in range(40)] for s in range(vocab)]
    tr = Translator(copy_with(base_dir, tmp_path, lists, frequent=[5, 9]), shortlist=True, precision="int8")
    want_kernel = ops.available()
    assert (tr.shortlist.op is candidates_kernel) == want_kernel
    assert ("shortlist", want_kernel) in tr.plan.bound
    want = tr.translate(lines)

    def asked(*a):
        raise AssertionError("the shortlist asked whether its kernel is loaded")
    monkeypatch.setattr(ops, "available", asked)
    assert tr.translate(lines) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_whole_vocabulary_shortlist_gives_the_same_output_with_cuda_graphs(base_dir, tmp_path, vocab, lines):
    d = copy_with(base_dir, tmp_path, [list(range(vocab))] * vocab)
    kw = dict(device="cuda", precision="fp32", cuda_graphs=True)
    assert Translator(d, shortlist=True, **kw).translate(lines) == Translator(d, **kw).translate(lines)


# -- the file in the model dir ----------------------------------------------------------------

def test_config_without_shortlist_still_loads_and_round_trips(base_dir):
    cfg = modeldir.read_config(base_dir)
    assert cfg.shortlist is None and "shortlist" not in cfg.to_json()["files"]
    with_file = modeldir.ModelConfig.from_json({**cfg.to_json(), "files": {"shortlist": "sl.safetensors"}})
    assert with_file.shortlist == "sl.safetensors"
    assert modeldir.ModelConfig.from_json(with_file.to_json()) == with_file


def one_line_error(d, **kw) -> str:
    with pytest.raises(ModelDirError) as e:
        Translator(d, shortlist=True, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_shortlist_switch_without_a_listed_file_names_the_config(base_dir):
    msg = one_line_error(base_dir)
    assert msg.startswith(os.path.join(base_dir, "config.json")) and "python -m student.shortlist" in msg


def test_missing_shortlist_file_is_one_error_naming_it(base_dir, tmp_path, vocab):
    d = copy_with(base_dir, tmp_path, [[5]] * vocab)
    os.remove(os.path.join(d, "shortlist.safetensors"))
    assert one_line_error(d).startswith(os.path.join(d, "shortlist.safetensors") + ": missing file")
    Translator(d, precision="fp32")  # without the switch the file is not needed (the submission image copies 3 files)


def test_malformed_shortlist_files_are_one_error_naming_the_file(base_dir, tmp_path, vocab):
    from safetensors.torch import save_file
    d = copy_with(base_dir, tmp_path, [[5]] * vocab)
    path = os.path.join(d, "shortlist.safetensors")
    good = dict(offsets=torch.arange(vocab + 1), ids=torch.full((vocab,), 5), frequent=torch.tensor([4]))
    cases = {
        "unreadable safetensors": None,
        "missing tensor frequent": {k: v for k, v in good.items() if k != "frequent"},
        "ids must be a 1-d int32/int64 tensor": {**good, "ids": good["ids"].float()},
        "offsets has": {**good, "offsets": torch.arange(vocab)},
        "offsets must rise": {**good, "offsets": torch.arange(vocab + 1).flip(0)},
        "ids holds token ids outside": {**good, "ids": torch.full((vocab,), vocab)},
        "frequent holds token ids outside": {**good, "frequent": torch.tensor([-1])},
    }
    for expected, tensors in cases.items():
        if tensors is None:
            with open(path, "wb") as fh:
                fh.write(b"not a safetensors file")
        else:
            save_file(tensors, path)
        msg = one_line_error(d)
        assert msg.startswith(path + ": ") and expected in msg, msg


def test_shortlist_entry_pointing_outside_the_model_dir_is_rejected(base_dir, tmp_path):
    d = str(tmp_path / "model")
    shutil.copytree(base_dir, d)
    cpath = os.path.join(d, "config.json")
    with open(cpath) as fh:
        cfg = json.load(fh)
    cfg["files"]["shortlist"] = "../elsewhere.safetensors"
    with open(cpath, "w") as fh:
        json.dump(cfg, fh)
    with pytest.raises(ModelDirError, match=r"config\.json: files\.shortlist must be a file name"):
        modeldir.read_config(d)


def test_writing_an_out_of_range_shortlist_fails_before_touching_the_model_dir(base_dir, tmp_path, vocab):
    d = str(tmp_path / "model")
    shutil.copytree(base_dir, d)
    with pytest.raises(ModelDirError, match="outside"):
        modeldir.write_shortlist(d, torch.tensor([0] * vocab + [1]), torch.tensor([vocab]),
                                 torch.tensor([], dtype=torch.long))
    assert not os.path.exists(os.path.join(d, "shortlist.safetensors"))
    assert modeldir.read_config(d).shortlist is None


def test_cli_reports_a_missing_shortlist_in_one_line(base_dir, tmp_path, vocab, capsys):
    from decoder.__main__ import main
    d = copy_with(base_dir, tmp_path, [[5]] * vocab)
    os.remove(os.path.join(d, "shortlist.safetensors"))
    assert main(["--model", d, "--shortlist"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "shortlist.safetensors" in err


# -- the builder ---------------------------------------------------------------------------------

def test_builder_pairs_each_source_token_with_its_translation():
    # word-for-word toy pair: source token 10+i is always translated by target token 40+i
    src_words, tgt_words = toy_parallel(200, seed=3)
    en = sorted({w for s in src_words for w in s.split()})
    es = sorted({w for s in tgt_words for w in s.split()})
    s_ids = [[10 + en.index(w) for w in s.split()] for s in src_words]
    t_ids = [[40 + es.index(w) for w in s.split()] + [2] for s in tgt_words]
    lex = build(s_ids, t_ids, 80, k=1, n_frequent=3, identity=False, exclude=(0, 1, 2, 3))
    pairs = {s: lex.ids[lex.offsets[s]:lex.offsets[s + 1]].tolist() for s in range(80)}
    from conftest import WORDS_EN, WORDS_ES
    for w_en, w_es in zip(WORDS_EN, WORDS_ES):
        if w_en in en:
            assert pairs[10 + en.index(w_en)] == [40 + es.index(w_es)], w_en
    assert all(not pairs[s] for s in range(80) if not 10 <= s < 10 + len(en))
    counts = torch.bincount(torch.tensor([t for s in t_ids for t in s]), minlength=80)
    counts[2] = 0  # </s> is excluded: the decoder always adds it
    assert lex.frequent.tolist() == counts.argsort(descending=True, stable=True)[:3].tolist()


def test_builder_lists_each_token_first_then_best_dice_first():
    src = [[5, 6], [5, 6], [5, 7], [6]]
    tgt = [[8, 9], [8, 9], [8], [9]]
    lex = build(src, tgt, 12, k=3, n_frequent=0, identity=True, exclude=(0, 1, 2, 3))
    get = lambda s: lex.ids[lex.offsets[s]:lex.offsets[s + 1]].tolist()  # noqa: E731
    # dice(5,8) = 2*3/(3+3) = 1, dice(5,9) = 2*2/(3+3); token 11 never seen: only itself
    assert get(5) == [5, 8, 9]
    assert get(6) == [6, 9, 8]
    assert get(11) == [11]
    assert get(2) == []  # special ids get no list
    assert lex.frequent.numel() == 0


def test_builder_rejects_unaligned_corpora():
    with pytest.raises(ValueError, match="2 source sentences but 1 target"):
        build([[4], [5]], [[6]], 10)


def test_add_to_model_dir_builds_a_shortlist_the_decoder_uses(base_dir, tmp_path, toy_files, lines):
    d = str(tmp_path / "model")
    shutil.copytree(base_dir, d)
    info = add_to_model_dir(d, str(toy_files / "train.en"), str(toy_files / "train.es"), k=20, n_frequent=10)
    assert info["pairs"] > 0 and modeldir.read_config(d).shortlist == "shortlist.safetensors"
    offsets, ids, frequent = modeldir.read_shortlist(d, modeldir.read_config(d))
    assert frequent.numel() == 10 and ids.numel() == int(offsets[-1])
    out = Translator(d, precision="fp32", shortlist=True).translate(lines)
    assert len(out) == len(lines)


def test_add_to_model_dir_names_the_file_of_a_line_count_mismatch(base_dir, tmp_path):
    from student.data import DataError
    (tmp_path / "a.en").write_text("one\ntwo\n")
    (tmp_path / "a.es").write_text("uno\n")
    with pytest.raises(DataError, match=r"a\.es: 1 lines, but .*a\.en has 2"):
        add_to_model_dir(base_dir, str(tmp_path / "a.en"), str(tmp_path / "a.es"))


# -- the builder streams: same lists, memory flat in the corpus -----------------------------------

def old_build(src, tgt, V, *, k=100, n_frequent=100, identity=True, exclude=(), block_mb=128):
    """student.shortlist.build before it streamed (every sentence in memory at once): the reference."""
    def flat(seqs):
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        tok = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)
        return torch.repeat_interleave(torch.arange(len(seqs)), lens), tok

    def distinct(sent, tok):
        keep = ~torch.isin(tok, ex)
        key = torch.unique(sent[keep] * V + tok[keep])
        return key // V, key % V
    ex = torch.tensor(sorted(set(exclude)), dtype=torch.long)
    (s_sent, s_all), (t_sent, t_all) = flat(src), flat(tgt)
    s_sent, s_tok = distinct(s_sent, s_all)
    t_sent, t_tok = distinct(t_sent, t_all)
    df_s, df_t = torch.bincount(s_tok, minlength=V), torch.bincount(t_tok, minlength=V)
    t_len = torch.bincount(t_sent, minlength=len(tgt))
    t_off = torch.cumsum(t_len, 0) - t_len
    occ = torch.bincount(t_all, minlength=V)
    occ[ex] = 0
    order = torch.sort(-occ, stable=True).indices
    frequent = order[:n_frequent][occ[order[:n_frequent]] > 0]
    special = torch.zeros(V, dtype=torch.bool)
    special[ex] = True
    rows = max(1, min(V, block_mb * 2 ** 20 // (4 * V)))
    lengths, ids = [], []
    for lo in range(0, V, rows):
        hi = min(V, lo + rows)
        m = (s_tok >= lo) & (s_tok < hi)
        bs, bt = s_sent[m], s_tok[m] - lo
        r = t_len[bs]
        pos = torch.repeat_interleave(t_off[bs] - (torch.cumsum(r, 0) - r), r) + torch.arange(int(r.sum()))
        key = torch.repeat_interleave(bt, r) * V + t_tok[pos]
        counts = torch.zeros((hi - lo) * V, dtype=torch.int32)
        counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        dice = counts.view(hi - lo, V).float().mul_(2)
        dice.div_((df_s[lo:hi, None].float() + df_t[None, :].float()).clamp_min_(1))
        if identity:
            i = torch.arange(hi - lo)
            dice[i, i + lo] = torch.where(special[lo:hi], dice[i, i + lo], 2.0)
        dice[special[lo:hi]] = 0
        val, idx = dice.topk(min(k, V), dim=1)
        lengths.append((val > 0).sum(1))
        ids.append(idx[val > 0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.cat(lengths), 0)])
    return offsets, torch.cat(ids).long(), frequent.long()


def same_lists(got, want):
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_streamed_builder_gives_the_lists_of_the_in_memory_builder(monkeypatch):
    # chunks, row blocks and index_add_ ranges all small, so the corpus crosses each many times
    monkeypatch.setattr(build_mod, "CHUNK", 37)
    monkeypatch.setattr(cooc, "MAX_PAIRS", 50)
    rng = np.random.default_rng(0)
    V = 2000  # block_mb=1: 131 rows a block, 16 blocks

    def sentences(n):  # Zipfian ids, empty sentences and special ids included
        return [np.minimum(rng.zipf(1.3, int(rng.integers(0, 25))) - 1, V - 1).tolist() for _ in range(n)]
    src, tgt = sentences(700), sentences(700)
    for opts in (dict(k=5, n_frequent=10), dict(k=50, n_frequent=0, identity=False), dict(k=1, n_frequent=3)):
        want = old_build(src, tgt, V, exclude=(0, 1, 2, 3), block_mb=1, **opts)
        same_lists(build(src, tgt, V, exclude=(0, 1, 2, 3), block_mb=1, **opts), want)
    same_lists(build(src[:5], tgt[:5], V, exclude=()), old_build(src[:5], tgt[:5], V))  # one chunk, no specials
    same_lists(build([], [], 50, k=3), old_build([], [], 50, k=3))


def test_builder_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"target token ids outside \[0, 10\)"):
        build([[4]], [[10]], 10)


def test_shortlist_of_files_is_the_in_memory_builders_on_the_same_lines(base_dir, tmp_path, toy_files, monkeypatch):
    monkeypatch.setattr(build_mod, "CHUNK", 97)
    monkeypatch.setattr(build_mod, "SUB", 30)
    src, tgt = (str(toy_files / f) for f in ("train.en", "train.es"))
    for max_lines in (0, 250):
        d = str(tmp_path / f"model{max_lines}")
        shutil.copytree(base_dir, d)
        info = add_to_model_dir(d, src, tgt, k=20, n_frequent=10, max_lines=max_lines)
        lines = [read_lines(f)[0][:max_lines or None] for f in (src, tgt)]
        cfg, s_ids, t_ids = encode_corpus(d, *lines)
        want = old_build(s_ids, t_ids, cfg.arch.vocab_size, k=20, n_frequent=10,
                         exclude=(cfg.bos_id, cfg.pad_id, cfg.eos_id, cfg.unk_id))
        same_lists(modeldir.read_shortlist(d, modeldir.read_config(d)), want)
        assert info["lines"] == (max_lines or 600)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".shortlist-")]  # its temp dir is gone


def test_shortlist_peak_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(build_mod, "CHUNK", 100)  # 2,000 pairs: 20 chunks
    torch.set_num_threads(1)
    d = make_model_dir(tmp_path / "model", seed=1, normaliser={})  # no Moses pass: the test takes seconds
    src, tgt = generate(2000, str(tmp_path / "synth"), "en", "de", seed=2, verbose=False)
    peaks = {}
    for n in (200, 500, 2000):  # 200: first-use costs land outside the measure
        tracemalloc.start()
        info = add_to_model_dir(d, src, tgt, k=20, n_frequent=10, max_lines=n)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert info["lines"] == n
    # measured: 1.0x (1.70 MB both); 4.0x (6.5 -> 26.1 MB) with the corpus read and encoded whole, as before
    assert peaks[2000] < 1.3 * peaks[500], peaks


def test_bench_precision_rows_are_alternatives_to_the_best_fp32_row():
    from tools.bench import ablation
    cumulative, variants = ablation()
    assert not any(kw.get("shortlist") for _, kw in cumulative + variants)
    last = cumulative[-1][1]
    assert last["precision"] == "fp32"
    fused = {"fused_norm", "fused_attention", "fused_project_argmax", "fused_encoder_attention",
             "fused_cross_attention"}
    int8 = {"fbgemm_int8", "fused_ops", "int8_gemv", "int8_vnni_int_mm", "int8_quantized_hidden", "int8_packed_gemm"}
    for _, kw in variants:  # each differs from the last fp32 row in precision (and its int8 kernel) or fused kernels only
        assert {k for k in kw if kw[k] != last.get(k, False)} <= {"precision"} | int8 | fused


def test_bench_best_is_the_fastest_row_within_the_bleu_bound():
    from tools.bench import pick_best
    fp32, int8, bf16 = ({"precision": p} for p in ("fp32", "int8", "bf16"))
    assert pick_best([(100, 20.0, fp32), (300, 19.9, int8), (200, 20.0, bf16)]) is int8
    assert pick_best([(100, 20.0, fp32), (300, 19.5, int8), (200, 20.0, bf16)]) is bf16  # int8 lost 0.5
    assert pick_best([(100, 20.0, fp32), (50, 20.0, int8)]) is fp32  # int8 slower here (AVX2)
