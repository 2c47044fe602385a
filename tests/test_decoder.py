"""Lean decoder: every optimisation switch leaves the tokens unchanged."""
import dataclasses
import random
import sys
import threading
import time

import pytest
import torch

from decoder import Translator
from decoder.batching import make_batches, padded, restore
from decoder.quant import Int8Linear
from fixture_model import make_model_dir, synthetic_corpus
from tools.naive import NaiveTranslator

NAIVE = dict(sort=False, softmax_free=False, early_stop=False, fused_qkv=False, pipeline=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model_dir(tmp_path_factory.mktemp("fixture") / "model", seed=1)


@pytest.fixture(scope="module")
def lines():
    return synthetic_corpus(40, seed=7)


@pytest.fixture(scope="module")
def fast(model_dir):
    return Translator(model_dir, precision="fp32")


@pytest.fixture(scope="module")
def srcs(fast, lines):
    return fast.text.encode(lines)


def test_fixture_outputs_are_not_degenerate(fast, srcs):
    out = fast.translate_ids(srcs)
    limits = fast.limits([len(s) for s in srcs]).tolist()
    assert any(len(o) < lim - 1 for o, lim in zip(out, limits)), "no sentence ends before the cap"
    assert any(len(o) == lim - 1 for o, lim in zip(out, limits)), "no sentence reaches the cap"
    assert len({t for o in out for t in o}) > 20


def test_optimised_greedy_equals_naive_reference(model_dir, fast, srcs, lines):
    naive = NaiveTranslator(model_dir, precision="fp32", **NAIVE)
    assert fast.translate_ids(srcs) == naive.translate_ids(srcs)
    assert fast.translate(lines) == naive.translate(lines)


def test_greedy_equals_training_model_greedy(model_dir, fast, srcs):
    from student.modeldir import load_model_dir
    ref, cfg = load_model_dir(model_dir)
    S = max(map(len, srcs))
    src = torch.tensor([s + [cfg.pad_id] * (S - len(s)) for s in srcs])
    assert fast.translate_ids(srcs) == ref.greedy(src)


def test_greedy_equals_training_model_with_tied_embeddings(tmp_path):
    from student.modeldir import load_model_dir
    d = make_model_dir(tmp_path / "tied", tie_embeddings=True, seed=3, enc=1, dec=1)
    tr = Translator(d, precision="fp32")
    srcs = tr.text.encode(synthetic_corpus(10, seed=2))
    ref, cfg = load_model_dir(d)
    S = max(map(len, srcs))
    src = torch.tensor([s + [cfg.pad_id] * (S - len(s)) for s in srcs])
    assert tr.translate_ids(srcs) == ref.greedy(src)


@pytest.mark.parametrize("switch", ["softmax_free", "early_stop", "fused_qkv", "sort", "pipeline",
                                    "fused_project_argmax"])
def test_each_switch_alone_leaves_greedy_tokens_unchanged(model_dir, fast, lines, switch):
    assert Translator(model_dir, precision="fp32", **{switch: False}).translate(lines) == fast.translate(lines)


# bf16 is left out: the kernels round once in fp32 where the plain path rounds
# after every op, so a random model's near-ties may break the other way
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_fused_norm_and_attention_keep_greedy_tokens(model_dir, lines, precision):
    # int8 on our `_int_mm` kernel: fbgemm's one activation scale per tensor turns
    # the fused LayerNorm's last-bit differences into whole quantisation steps,
    # and this random model's near-ties flip (11 of 40 lines with fused_norm)
    kw = dict(precision=precision, fbgemm_int8=False)
    plain = Translator(model_dir, **kw).translate(lines)
    assert Translator(model_dir, **kw, fused_norm=True, fused_attention=True).translate(lines) == plain


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_fused_projection_argmax_keeps_greedy_tokens(model_dir, lines, precision):
    # int8 projections take the logits and the C++ argmax instead
    kw = dict(precision=precision, max_sentences=16)
    plain = Translator(model_dir, fused_project_argmax=False, **kw).translate(lines)
    assert Translator(model_dir, fused_project_argmax=True, **kw).translate(lines) == plain


@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("chunk", [7, 64, 100000])
def test_project_argmax_equals_the_argmax_of_the_logits(model_dir, rows, chunk):
    m = Translator(model_dir, precision="fp32").model
    y = torch.randn(rows, m.d, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(m.project_argmax(y, chunk=chunk), m.project(y).argmax(-1))
    vocab = torch.arange(0, m.out_proj.w.shape[0], 3)  # a shortlist's sliced projection
    out = m.output_rows(vocab)
    assert torch.equal(m.project_argmax(y, out, chunk=chunk), m.project(y, out).argmax(-1))


@pytest.mark.parametrize("beam", [2, 4])
def test_fused_topk_keeps_beam_hypotheses(model_dir, srcs, beam):
    sub = srcs[:16]
    fused = Translator(model_dir, precision="fp32", beam=beam, fused_topk=True, fused_attention=True)
    assert (fused.translate_ids(sub)
            == Translator(model_dir, precision="fp32", beam=beam, fused_topk=False).translate_ids(sub))


@pytest.mark.parametrize("beam", [2, 4])
def test_fused_log_softmax_changes_beam_hypotheses_at_most_at_near_ties(model_dir, srcs, beam):
    # its log-probs round differently from ATen's, so a near tie may go the other way
    sub = srcs[:16]
    a = Translator(model_dir, precision="fp32", beam=beam, fused_topk=True, fused_log_softmax=True).translate_ids(sub)
    b = Translator(model_dir, precision="fp32", beam=beam, fused_topk=False).translate_ids(sub)
    assert sum(x != y for x, y in zip(a, b)) <= 2


def _has_repeated_ngram(ids, n):
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("beam", [1, 3])
def test_no_repeat_ngram_leaves_no_ngram_twice_with_kernel_or_reference(model_dir, srcs, beam):
    sub = srcs[:16]
    plain = Translator(model_dir, precision="fp32", beam=beam).translate_ids(sub)
    assert any(_has_repeated_ngram(h, 2) for h in plain)  # the random model repeats itself
    blocked = Translator(model_dir, precision="fp32", beam=beam, no_repeat_ngram=2).translate_ids(sub)
    assert not any(_has_repeated_ngram(h, 2) for h in blocked)
    assert Translator(model_dir, precision="fp32", beam=beam, no_repeat_ngram=2, fused_ngram=False).translate_ids(sub) == blocked


def test_greedy_with_and_without_softmax_identical(model_dir, fast, srcs):
    assert Translator(model_dir, precision="fp32", softmax_free=False).translate_ids(srcs) == fast.translate_ids(srcs)


@pytest.mark.parametrize("early_stop", [True, False])
def test_beam_with_cache_equals_beam_without_cache(model_dir, srcs, early_stop):
    sub = srcs[:12]
    a = Translator(model_dir, precision="fp32", beam=3, early_stop=early_stop).translate_ids(sub)
    b = NaiveTranslator(model_dir, precision="fp32", beam=3, early_stop=early_stop).translate_ids(sub)
    assert a == b


def test_beam_early_stop_does_not_change_hypotheses(model_dir, srcs):
    sub = srcs[:12]
    assert (Translator(model_dir, precision="fp32", beam=4).translate_ids(sub)
            == Translator(model_dir, precision="fp32", beam=4, early_stop=False).translate_ids(sub))


def test_beam_scores_at_least_as_well_as_greedy(model_dir, fast, srcs):
    """Beam 4 with no length penalty finds a sequence at least as probable as greedy."""
    from student.modeldir import load_model_dir
    ref, cfg = load_model_dir(model_dir)
    beam = Translator(model_dir, precision="fp32", beam=4, length_penalty=0.0).translate_ids(srcs[:8])
    greedy = fast.translate_ids(srcs[:8])

    def logprob(s, t):
        tgt = torch.tensor([[cfg.decoder_start_id] + t])
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([s]), tgt), -1)[0]
        return float(lp[torch.arange(len(t) + 1), torch.tensor(t + [cfg.eos_id])].sum())
    for s, b, g in zip(srcs[:8], beam, greedy):
        assert logprob(s, b) >= logprob(s, g) - 1e-4


def test_output_order_restored_for_shuffled_lengths(fast, lines):
    shuffled = lines[:]
    random.Random(3).shuffle(shuffled)
    one_by_one = [fast.translate([s])[0] for s in shuffled]
    assert fast.translate(shuffled) == one_by_one


@pytest.mark.parametrize("max_tokens,max_sentences,chunk", [(1, 1, 20000), (60, 4, 7), (100000, 1000, 20000)])
def test_results_independent_of_batch_size_and_token_budget(model_dir, fast, lines, max_tokens,
                                                            max_sentences, chunk):
    tr = Translator(model_dir, precision="fp32", max_tokens=max_tokens, max_sentences=max_sentences, chunk_lines=chunk)
    assert tr.translate(lines) == fast.translate(lines)


def test_chunks_keep_every_line_in_order_and_cut_at_the_characters():
    from decoder.pipeline import chunks
    lines = [str(i) for i in range(40)]
    assert [len(c) for c in chunks(lines, 16)] == [16, 16, 8] and sum(chunks(lines, 16), []) == lines
    assert [len(c) for c in chunks(["ab"] * 20, 16, max_chars=6)] == [3] * 6 + [2]


def test_the_pipeline_threads_run_at_the_given_switch_interval_and_it_is_restored():
    from decoder.pipeline import run
    before, seen = sys.getswitchinterval(), []

    def pre(c):
        seen.append(("pre", sys.getswitchinterval()))
        return c

    def post(s):
        seen.append(("post", sys.getswitchinterval()))
        return s.upper()

    def compute(c, submit):
        futs = [submit(post, s) for s in c]
        return lambda: [f.result() for f in futs]
    lines = [f"line {i}" for i in range(7)]
    assert list(run(lines, 3, pre, compute, switch_interval=0.0002)) == [s.upper() for s in lines]
    assert {k for k, _ in seen} == {"pre", "post"} and [v for _, v in seen] == pytest.approx([0.0002] * len(seen))
    assert sys.getswitchinterval() == before
    early = run(lines, 3, pre, compute, switch_interval=0.0002)
    next(early)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    early.close()  # a reader that stops early
    assert sys.getswitchinterval() == before

    def fails(c, submit):
        raise ValueError("a chunk failed")
    with pytest.raises(ValueError, match="a chunk failed"):
        list(run(lines, 3, pre, fails, switch_interval=0.0002))
    assert sys.getswitchinterval() == before
    seen.clear()
    assert list(run(lines, 3, pre, compute)) == [s.upper() for s in lines]
    assert {v for _, v in seen} == {before}  # None: Python's own


def upper_compute(log):
    """A pipeline compute that upper-cases its chunk in post tasks, logging where and when it ran."""
    def compute(c, submit):
        log.append(("compute", c[0], threading.current_thread().name))
        futs = [submit(str.upper, s) for s in c]
        return lambda: [f.result() for f in futs]
    return compute


def test_decode_ahead_computes_the_next_chunk_while_this_ones_outputs_go_out():
    from decoder.pipeline import run
    lines = [f"line {i}" for i in range(10)]
    started = {c: threading.Event() for c in ("line 0", "line 3", "line 6", "line 9")}
    names: list = []
    compute = upper_compute(names)

    def marked(c, submit):  # a chunk takes longer than reading the next one, as a GPU's does
        started[c[0]].set()
        time.sleep(0.05)
        return compute(c, submit)
    out = []
    for s in run(lines, 3, lambda c: c, marked, decode_ahead=True):
        if s in ("LINE 0", "LINE 3", "LINE 6"):  # a chunk's first output: the next one is under way
            assert started[lines[lines.index(s.lower()) + 3]].wait(10), s
        out.append(s)
    assert out == [s.upper() for s in lines]
    assert len(names) == 4 and all(name.startswith("decode") for _, _, name in names)


def test_decode_ahead_hands_a_chunk_out_before_waiting_for_the_next_lines():
    # a pipe's writer sends the next lines only once it has the answer to the ones before
    from decoder.pipeline import run
    answered = threading.Event()

    def writer():
        yield from ["a", "b"]
        assert answered.wait(10), "the decoder waited for lines before answering the ones it had"
        yield "c"
    got = []
    for s in run(writer(), 2, lambda c: c, upper_compute([]), decode_ahead=True):
        got.append(s)
        answered.set()
    assert got == ["A", "B", "C"]


def test_decode_ahead_raises_what_the_decoding_raised_and_stops_when_the_reader_does():
    from decoder.pipeline import run

    def fails(c, submit):
        if c[0] == "x 3":
            raise ValueError("chunk 2 failed")
        return lambda: c
    lines = [f"x {i}" for i in range(9)]
    got = []
    with pytest.raises(ValueError, match="chunk 2 failed"):
        for s in run(lines, 3, lambda c: c, fails, decode_ahead=True):
            got.append(s)
    assert got == lines[:3]  # the first chunk's outputs, none lost or shifted
    early = run(lines, 3, lambda c: c, upper_compute([]), decode_ahead=True)
    assert next(early) == "X 0"
    early.close()


@pytest.mark.parametrize("beam", [1, 3])
def test_the_translator_decoding_ahead_gives_the_same_outputs(model_dir, lines, beam, monkeypatch):
    want = Translator(model_dir, precision="fp32", beam=beam).translate(lines)
    tr = Translator(model_dir, precision="fp32", beam=beam, chunk_lines=7)
    assert not tr.plan.decode_ahead  # a CPU plan (decode_ahead is CUDA's)
    monkeypatch.setattr(tr, "plan", dataclasses.replace(tr.plan, decode_ahead=True))
    names, compute = [], tr._compute
    monkeypatch.setattr(tr, "_compute", lambda *a: names.append(threading.current_thread().name) or compute(*a))
    assert tr.translate(lines) == want
    assert len(names) > 2 and all(n.startswith("decode") for n in names)


def test_the_translator_runs_its_pipeline_at_the_plans_switch_interval(model_dir, fast, lines, monkeypatch):
    tr = Translator(model_dir, precision="fp32")
    assert tr.plan.switch_interval is None  # a CPU plan (short_gil_interval is CUDA's)
    monkeypatch.setattr(tr, "plan", dataclasses.replace(tr.plan, switch_interval=0.0003))
    seen, encode = [], tr._encode
    monkeypatch.setattr(tr, "_encode", lambda c: seen.append(sys.getswitchinterval()) or encode(c))
    assert tr.translate(lines) == fast.translate(lines)
    assert seen and seen == pytest.approx([0.0003] * len(seen))


@pytest.mark.parametrize("beam", [1, 3])
def test_encode_ahead_encodes_the_next_batch_before_this_ones_search(model_dir, lines, beam, monkeypatch):
    want = Translator(model_dir, precision="fp32", beam=beam, max_sentences=4).translate(lines)
    tr = Translator(model_dir, precision="fp32", beam=beam, max_sentences=4)
    assert not tr.plan.encode_ahead  # a CPU plan (encode_ahead is CUDA's)
    monkeypatch.setattr(tr, "plan", dataclasses.replace(tr.plan, encode_ahead=True))
    events, encode, search = [], tr.encode_batch, tr.search_batch
    monkeypatch.setattr(tr, "encode_batch", lambda b: (events.append("encode"), encode(b))[1])
    monkeypatch.setattr(tr, "search_batch", lambda e: (events.append("search"), search(e))[1])
    assert tr.translate(lines) == want
    n = events.count("search")
    assert n > 2 and events == ["encode"] + ["encode", "search"] * (n - 1) + ["search"]


def test_the_device_beams_best_is_the_first_of_equal_normalised_scores_cut_at_its_length():
    import numpy as np
    from decoder.search import NEG_INF, pick_best
    # two sentences, K=2 (slot K: the ends not kept); rows: length, then tokens (9: past the length)
    rows = np.array([[1, 5, 9, 9], [2, 6, 7, 9], [0, 9, 9, 9],
                     [3, 4, 4, 4], [1, 8, 9, 9], [0, 9, 9, 9]])
    # length penalty 1: sentence 0's -2/2 and -3/3 tie (the first wins), sentence 1's -1.5/2 beats -8/4;
    # length penalty 0: the raw scores, an unused slot (NEG_INF) never chosen
    assert pick_best([[-2.0, -3.0], [-8.0, -1.5]], rows, 3, 1.0) == [[5], [8]]
    assert pick_best([[-3.0, -2.0], [-8.0, NEG_INF]], rows, 3, 0.0) == [[6, 7], [4, 4, 4]]


def test_beam_results_independent_of_batch_size(model_dir, srcs):
    a = Translator(model_dir, precision="fp32", beam=3, max_sentences=1).translate_ids(srcs[:10])
    b = Translator(model_dir, precision="fp32", beam=3).translate_ids(srcs[:10])
    assert a == b


def test_empty_lines_give_empty_outputs_without_the_model(fast, monkeypatch):
    seen = []
    orig = fast.start_ids  # every batch reaches the model through it
    monkeypatch.setattr(fast, "start_ids", lambda s: seen.append(s) or orig(s))
    out = fast.translate(["", "   ", "the dog", "\t", ""])
    assert [o == "" for o in out] == [True, True, False, True, True]
    assert [len(s) for batch in seen for s in batch] and all(len(b) == 1 for b in seen)
    assert fast.translate(["", ""]) == ["", ""]


@pytest.mark.parametrize("beam", [1, 3])
def test_worker_processes_give_the_one_process_output(model_dir, lines, beam):
    """Whole batches go to the workers, so the batches (and their numerics) are
    those of one process with one thread, across chunk borders and empty lines."""
    mixed = lines[:25] + ["", "   "] + lines[25:]
    opts = dict(beam=beam, chunk_lines=15, max_sentences=4)
    one = Translator(model_dir, threads=1, **opts)
    want = one.translate(mixed)
    ids = one.text.encode(["the dog", "a cat"])
    with Translator(model_dir, workers=2, **opts) as tr:
        assert tr.model is None  # the parent holds no model copy
        assert tr.translate(mixed) == want
        assert tr.translate_ids(ids) == one.translate_ids(ids)


def test_worker_processes_encode_a_share_of_each_big_chunk(model_dir, lines):
    """A chunk of SPLIT_ENCODE_LINES lines or more is tokenised in the workers, one
    contiguous share each, and batches come back as text; the output is still one
    process's, empty lines included."""
    mixed = (lines + ["", "  "] + lines)[:Translator.SPLIT_ENCODE_LINES + 2]
    one = Translator(model_dir, precision="fp32", threads=1, chunk_lines=len(mixed))
    with Translator(model_dir, precision="fp32", workers=2, chunk_lines=len(mixed)) as tr:
        calls, submit = [], tr.pool.submit
        tr.pool.submit = lambda arg, method="translate_ids": calls.append((method, arg)) or submit(arg, method)
        assert tr.translate(mixed) == one.translate(mixed)
        assert tr.translate(mixed[:5]) == one.translate(mixed[:5])  # a small chunk: the parent encodes
    shares = [arg for method, arg in calls if method == "ids"]
    assert len(shares) == 2 and shares[0] + shares[1] == mixed and all(shares)
    assert {method for method, _ in calls} == {"ids", "translate_text"}


def test_shares_are_contiguous_nonempty_and_about_equal_in_characters():
    from decoder.translator import shares
    rng = random.Random(3)
    for _ in range(200):
        lines = ["x" * rng.randrange(0, 60) for _ in range(rng.randrange(1, 90))]
        n = rng.randrange(1, 5)
        got = shares(lines, n)
        assert [i for lo, hi in got for i in range(lo, hi)] == list(range(len(lines)))
        assert 1 <= len(got) <= n and all(hi > lo for lo, hi in got)
        if len(got) == n:  # each share within one line's length of an equal share
            chars = [sum(map(len, lines[lo:hi])) for lo, hi in got]
            assert all(abs(c - sum(chars) / n) <= max(map(len, lines)) for c in chars), (chars, n)


def test_too_long_input_is_truncated_with_one_warning(model_dir, capsys):
    tr = Translator(model_dir, precision="fp32", max_len_a=0.0, max_len_b=5)  # short outputs keep this fast
    out = tr.translate(["the big dog " * 2000, "the old " * 3000, "a cat"])
    assert len(out) == 3
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "truncating" in err


def test_outputs_never_contain_line_breaks(fast):
    out = fast.translate(["line\u2028with separators\x85and\rcr"] + ["x\x0by"] * 3)
    assert len(out) == 4 and not any(c in o for o in out for c in "\r\n\u2028\u2029\x85\x0b")


def test_batches_respect_budget_and_restore_order():
    lengths = [random.Random(i).randint(1, 50) for i in range(200)]
    batches = make_batches(lengths, max_tokens=300, max_sentences=16)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        assert len(b) <= 16 and (len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 300)
    assert restore(batches, [[lengths[i] for i in b] for b in batches], 200) == lengths
    unsorted = make_batches(lengths, max_tokens=300, max_sentences=16, sort=False)
    assert [i for b in unsorted for i in b] == list(range(200))


def test_padded_rows_keep_their_ids_in_order_and_pad_the_rest():
    seqs = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    want = torch.tensor([[5, 6, 7, 1], [8, 1, 1, 1], [9, 10, 11, 12], [13, 14, 1, 1]])
    assert torch.equal(padded(seqs, 1), want)
    assert padded(seqs, 1).dtype == torch.long and padded([[3]], 0).tolist() == [[3]]


def test_int8_linear_is_close_to_fp32():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 64, generator=g) / 8, torch.randn(96, generator=g), torch.randn(5, 7, 64, generator=g)
    ref = torch.nn.functional.linear(x, w, b)
    got = Int8Linear(w, b)(x)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < 0.03 * ref.abs().max()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_low_precision_runs_and_keeps_one_line_per_input(model_dir, lines, precision):
    out = Translator(model_dir, precision=precision).translate(lines + [""])
    assert len(out) == len(lines) + 1 and out[-1] == ""


def test_cuda_request_falls_back_to_cpu(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tr = Translator(model_dir, device="cuda", precision="fp16")
    assert tr.device == "cpu" and tr.precision in ("int8", "fp32")
    assert len(tr.translate(["the dog", ""])) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize("beam", [1, 3])
def test_fixed_shape_state_for_cuda_graphs_gives_same_tokens(model_dir, srcs, beam):
    """The CUDA-graph step (whole-cache attention with a position mask) runs eagerly
    on CPU here; its tokens must equal the shrinking incremental decoder's."""
    sub = srcs[:12]
    a = Translator(model_dir, precision="fp32", beam=beam, static_shapes=True).translate_ids(sub)
    b = Translator(model_dir, precision="fp32", beam=beam).translate_ids(sub)
    assert a == b


@pytest.mark.parametrize("beam", [1, 3])
def test_fixed_shape_state_with_fused_kernels_gives_same_tokens(model_dir, srcs, beam):
    """What a CUDA graph captures with fused_norm, run eagerly on CPU;
    the fused argmax switches apply around the graphed step."""
    sub = srcs[:12]
    a = Translator(model_dir, precision="fp32", beam=beam, static_shapes=True, fused_norm=True,
                   fused_project_argmax=True, fused_topk=True).translate_ids(sub)
    assert a == Translator(model_dir, precision="fp32", beam=beam, fused_project_argmax=False, fused_topk=False).translate_ids(sub)


def test_beam_search_batches_half_the_source_tokens_unless_told(model_dir):
    from decoder.cliargs import BEAM_MAX_TOKENS, MAX_TOKENS
    assert Translator(model_dir, precision="fp32").opts.max_tokens == MAX_TOKENS
    assert Translator(model_dir, precision="fp32", beam=4).opts.max_tokens == BEAM_MAX_TOKENS < MAX_TOKENS
    assert Translator(model_dir, precision="fp32", beam=4, max_tokens=999).opts.max_tokens == 999
    # the workers get the resolved number, not a None to resolve again
    assert Translator(model_dir, precision="fp32", beam=2).opts.flat()["max_tokens"] == BEAM_MAX_TOKENS
