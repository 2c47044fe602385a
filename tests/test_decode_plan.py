"""One resolution of the decode configuration (decoder/optimisations.py `resolve`):
after the device, the beam and the loaded kernels are known, into the loop, the
state and the kernels the step calls; the batch sizes of each device
(decoder/cliargs.py); and the loops' host reads every few steps (decoder/search.py
`greedy`, `beam`), which decoder/hostsync.py counts; the
fused ops the plan binds once, kernels or references, so the step never asks."""
import contextlib
import math
import os
from types import SimpleNamespace

import pytest
import torch

from decoder import fused, hostsync, ops, search
from decoder import optimisations as opt
from decoder.cliargs import (BEAM_MAX_TOKENS, GPU_MAX_SENTENCES, GPU_MAX_TOKENS, MAX_SENTENCES, MAX_TOKENS,
                             max_sentences_for, max_tokens_for)
from decoder.optimisations import CrossPlain, Kernels, Switches, encoder_attend_plain, resolve
from decoder.translator import Options

BOTH = Kernels(cpu=True, cuda=True)
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
MODEL, SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")
trained = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "config.json")),
                             reason="trained fixture tests/fixtures/bible-tiny is absent")


# -- the plan, per device ------------------------------------------------------------------------

def test_cpu_plan_runs_the_per_step_loops_and_the_cpu_kernels():
    g = resolve(Switches(), device="cpu", beam=1, kernels=BOTH)
    st = g.states
    assert (g.device, g.loop, st.eager, st.one_row, st.static, st.graphs, g.every, g.kernels) == \
        ("cpu", "greedy", "incremental", True, False, False, 1, True)
    assert st.kind(1, 1) == "one_row" and st.kind(5, 1) == "incremental" and g.search is opt.greedy_or_one
    assert g.encoder_attend.func is opt.encoder_attend_fused and g.cross_kv is not CrossPlain
    b = resolve(Switches(), device="cpu", beam=4, kernels=BOTH)
    assert (b.loop, b.states.eager, b.states.one_row, b.search) == ("beam", "row_table", False, search.beam)
    assert "kv_row_table" in b.runs and b.states.kind(1, 4) == "row_table"  # one sentence in a beam: no one-row
    fixed = resolve(Switches(), kernels=BOTH, static_shapes=True).states
    assert fixed.kind(1, 1) == fixed.kind(10_000, 1) == "static" and not fixed.graphs
    assert resolve(Switches(one_row=False), kernels=BOTH).search is search.greedy


def test_cpu_plan_without_the_cpp_ops_holds_the_same_math_without_them():
    p = resolve(Switches(), device="cpu", beam=1, kernels=Kernels(cpu=False, cuda=False))
    assert not p.kernels and p.encoder_attend is encoder_attend_plain and p.cross_kv is CrossPlain
    st = p.states
    assert not st.one_row_layer and not st.one_row_step and {"one_row_layer", "one_row_step"}.isdisjoint(p.runs)


def test_cuda_plan_replays_graphs_for_small_greedy_batches_and_every_beam_and_reads_every_few_steps():
    for beam in (1, 4):
        p = resolve(Switches(), device="cuda", beam=beam, kernels=BOTH)
        st = p.states
        assert (p.device, st.static, st.graphs, st.one_row, p.kernels) == ("cuda", True, True, False, True)
        assert p.loop == ("beam" if beam > 1 else "greedy") and p.every == opt.SYNC_EVERY["cuda"] > 1
        assert p.runs.isdisjoint(opt.CPU_ONLY) and "cuda_graphs" in p.runs
        assert p.encoder_attend is encoder_attend_plain and p.cross_kv is CrossPlain
    greedy = resolve(Switches(), device="cuda", kernels=BOTH).states
    # thousands of greedy rows decode eagerly: 1.18x there without graphs (docs/bench/gpu.md)
    assert greedy.kind(opt.GRAPH_ROWS, 1) == "static" and greedy.kind(opt.GRAPH_ROWS + 1, 1) == "incremental"
    assert resolve(Switches(), device="cuda", beam=4, kernels=BOTH).states.kind(10_000, 4) == "static"
    assert resolve(Switches(), device="cuda:0", kernels=BOTH).device == "cuda"
    # graphs off: the incremental state, also for a beam (the row_table state is the CPU's)
    eager = resolve(Switches(cuda_graphs=False), device="cuda", beam=4, kernels=BOTH).states
    assert eager.kind(1, 4) == "incremental" and not eager.static
    assert resolve(Switches(cuda_graphs=False), device="cuda", kernels=BOTH).states.kind(1, 1) == "one_row"
    assert not resolve(Switches(), device="cuda", kernels=Kernels(cpu=True, cuda=False)).kernels


def test_cuda_graphs_replay_no_shortlist_and_no_ngram_blocking():
    """A graph replays fixed addresses: a batch's candidates or n-gram histories are not."""
    with_graphs = resolve(Switches(), device="cuda", kernels=BOTH, has_shortlist=True)
    assert with_graphs.states.graphs and not with_graphs.shortlist
    listed = resolve(Switches(cuda_graphs=False), device="cuda", kernels=BOTH, has_shortlist=True)
    assert listed.shortlist and not listed.states.static
    assert not resolve(Switches(), device="cuda", kernels=BOTH, no_repeat_ngram=2).states.graphs


def test_the_shortlist_runs_by_default_where_the_model_dir_has_one():
    assert resolve(Switches(), kernels=BOTH, has_shortlist=True).shortlist
    assert not resolve(Switches(), kernels=BOTH, has_shortlist=False).shortlist
    assert not resolve(Switches(shortlist=False), kernels=BOTH, has_shortlist=True).shortlist


def test_the_row_table_resolves_on_cuda_for_the_graphs_beam_state_through_its_kernel_only():
    on = resolve(Switches(), device="cuda", beam=4, kernels=BOTH)
    assert (on.states.static, on.states.masked_attend, on.states.row_table) == (True, True, True)
    assert "kv_row_table" in on.runs
    refused = Kernels(cpu=True, cuda=True, cuda_refused=frozenset({"decode_attention_rows"}))
    for p in (resolve(Switches(), device="cuda", beam=4, kernels=refused),  # its kernel refused alone
              resolve(Switches(graph_attention=False), device="cuda", beam=4, kernels=BOTH),  # SDPA reads no table
              resolve(Switches(), device="cuda", beam=4, kernels=Kernels(cpu=True, cuda=False)),  # no CUDA kernels
              resolve(Switches(cuda_graphs=False), device="cuda", beam=4, kernels=BOTH),  # the eager state
              resolve(Switches(kv_row_table=False), device="cuda", beam=4, kernels=BOTH)):
        assert not p.states.row_table and "kv_row_table" not in p.runs and p.states.eager != "row_table"
    assert "no kv_row_table" in resolve(Switches(), device="cuda", beam=4, kernels=refused).summary()


def test_the_gpu_feeding_switches_resolve_on_cuda_only():
    names = {"short_gil_interval", "encode_ahead", "decode_ahead"}
    cuda = resolve(Switches(), device="cuda", kernels=BOTH)
    assert cuda.switch_interval == 0.0002 and cuda.encode_ahead and cuda.decode_ahead
    off = resolve(Switches(**{n: False for n in names}), device="cuda", kernels=BOTH)
    assert off.switch_interval is None and not off.encode_ahead and not off.decode_ahead
    cpu = resolve(Switches(), device="cpu", kernels=BOTH)
    assert cpu.switch_interval is None and not cpu.encode_ahead and not cpu.decode_ahead
    assert names <= cuda.runs and not names & cpu.runs


def test_sync_interval_is_a_plan_setting_on_any_device():
    assert resolve(Switches(), device="cpu", kernels=BOTH, sync_every=8).every == 8
    assert resolve(Switches(), device="cuda", kernels=BOTH, sync_every=1).every == 1


def test_plan_summary_says_the_loop_state_graphs_reads_and_what_differs():
    cpu = resolve(Switches(), device="cpu", beam=4, kernels=BOTH).summary()
    assert cpu.startswith("beam loop, row_table state") and "CUDA graphs off" in cpu and "every step" in cpu
    cuda = resolve(Switches(graph_attention=False), device="cuda", beam=1, kernels=BOTH).summary("fp16")
    assert f"fixed-shape state up to {opt.GRAPH_ROWS} rows" in cuda and "CUDA graphs on" in cuda
    assert "every 8 steps" in cuda and "no graph_attention" in cuda.split(";")[1]
    assert "no fused_encoder_attention" in cuda
    assert "\n" not in cuda and "kv_row_table" not in cuda  # a beam switch, not greedy's


# -- the fused ops, bound once for the device, the precision and the kernels loaded ---------------

NONE = Kernels(cpu=False, cuda=False)
FUSED_ARGMAX = dict(fused_project_argmax=False)  # the argmax on written logits, not the step's


def bound_ops(p) -> set:
    """The fused.Ops each slot that calls fused ops was bound to."""
    return {p.add_norm.args[0], p.topk.args[0]}


def test_plan_binds_the_references_where_the_kernels_are_absent():
    for device, kernels in (("cpu", NONE), ("cuda", Kernels(cpu=True, cuda=False))):  # CUDA: its own kernels
        p = resolve(Switches(**FUSED_ARGMAX), device=device, beam=1, kernels=kernels)
        assert p.ops is fused.REFERENCE and bound_ops(p) == {fused.REFERENCE}
        assert p.attend is fused.decode_attention_reference
        assert p.ops.argmax_rows is fused.argmax_rows_reference and p.ops.linear_argmax is fused.linear_argmax_reference
        # the references keep the kernels' argument checks where the public wrappers had them
        with pytest.raises(ops.OpArgumentError, match="same rows"):
            p.block(torch.ones(2, 5), torch.ones(3, 4, dtype=torch.long), 2)


def test_a_self_check_that_stops_refuses_every_cuda_kernel_with_one_warning(monkeypatch, capsys):
    def stops(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    monkeypatch.setattr(fused, "_cuda", {})
    monkeypatch.setattr(ops, "cuda_available", lambda: True)
    refused = []
    monkeypatch.setattr(ops, "cuda_refused", refused.append)
    monkeypatch.setattr(fused, "self_check", stops)
    assert fused._cuda_kernels() is False and fused.cuda_refused_alone() == set()
    assert refused == ["disagree with their references: the self-check stopped: CUDA error: an illegal memory "
                       "access was encountered"]
    assert capsys.readouterr().err.count("\n") == 1


OWN = {"decode_attention_rows": "the K/V cache moved at each beam reorder (kv_row_table off)"}


@pytest.mark.parametrize("bad, cuda_on", [(["decode_attention_rows"], True),
                                          (["decode_attention_rows", "argmax_rows"], False)])
def test_a_self_check_refuses_a_kernel_with_its_own_fallback_alone_or_every_cuda_kernel(bad, cuda_on, monkeypatch,
                                                                                        capsys):
    monkeypatch.setattr(fused, "_cuda", {})
    monkeypatch.setattr(ops, "cuda_available", lambda: True)
    monkeypatch.setattr(ops, "cuda_refused", lambda why: None)
    monkeypatch.setattr(fused, "self_check", lambda device: bad)
    assert fused._cuda_kernels() is cuda_on
    assert fused.cuda_refused_alone() == (set(bad) if cuda_on else set())
    err = capsys.readouterr().err
    for name in set(bad) & OWN.keys():
        assert f"the CUDA kernel {name} disagrees with its reference; CUDA uses {OWN[name]}" in err
    assert ("fused CUDA kernels disagree" in err) is not cuda_on


def test_plan_binds_the_references_where_the_cpp_ops_are_switched_off(monkeypatch):
    monkeypatch.setattr(ops, "_state", {})  # as in a new process started with DECODER_NO_CPP_OPS=1
    monkeypatch.setattr(fused, "_cuda", {})
    monkeypatch.setenv("DECODER_NO_CPP_OPS", "1")
    p = resolve(Switches())
    assert not p.kernels and p.ops is fused.REFERENCE and p.attend is fused.decode_attention_reference
    assert resolve(Switches(), device="cuda").ops is fused.REFERENCE


def test_plan_binds_the_kernels_of_its_device_where_they_are_loaded():
    cpu = resolve(Switches(**FUSED_ARGMAX), device="cpu", beam=4, kernels=BOTH)
    assert cpu.ops is fused.CPU_KERNELS and bound_ops(cpu) == {fused.CPU_KERNELS}
    assert cpu.attend is fused.decode_attention_kernel and cpu.ops.argmax_rows is fused.argmax_rows_kernel
    assert cpu.block is fused.ngram_block_kernel and cpu.encoder_attend.args[0] is fused.CPU_KERNELS
    cuda = resolve(Switches(**FUSED_ARGMAX), device="cuda", beam=4, kernels=BOTH, precision="fp16")
    assert cuda.ops is fused.CUDA_KERNELS and bound_ops(cuda) == {fused.CUDA_KERNELS}
    assert cuda.attend is fused.decode_attention_cuda and cuda.ops.argmax_rows is fused.argmax_rows_kernel
    # csrc/fused_cuda.cu has no encoder attention nor cross-attention store
    assert not cuda.ops.is_kernel("encoder_attention") and not cuda.ops.is_kernel("cross_store")
    assert cuda.ops.is_kernel("log_softmax_topk") and cuda.ops.log_softmax_topk is fused.log_softmax_topk_cuda
    # plans of one device and precision compare equal: the same bound callables
    assert resolve(Switches(), kernels=BOTH, precision="int8") == resolve(Switches(), kernels=BOTH)


def test_argmax_kernels_are_bound_only_for_the_dtypes_they_compare_in():
    assert fused.bound("cpu", torch.float64, True).argmax_rows is fused.argmax_rows_reference
    assert fused.bound("cpu", torch.float64, True).decode_attention is fused.decode_attention_kernel
    for precision in ("fp32", "bf16", "int8"):  # int8's activations are fp32
        assert resolve(Switches(), kernels=BOTH, precision=precision).ops.is_kernel("argmax_rows")


@trained
@pytest.mark.parametrize("kw", [dict(beam=1), dict(beam=4), dict(beam=1, max_sentences=1),
                                dict(beam=2, no_repeat_ngram=2), dict(beam=1, no_repeat_ngram=2, **FUSED_ARGMAX),
                                dict(beam=1, precision="int8"), dict(beam=1, max_sentences=1, precision="int8"),
                                dict(beam=4, kv_row_table=False)],
                         ids=["greedy", "beam", "one-row", "beam-ngram", "greedy-ngram-argmax", "int8", "int8-one-row",
                              "beam-moved-kv"])
def test_the_step_never_asks_whether_a_kernel_is_loaded(lines, monkeypatch, kw):
    """After the plan is resolved no call of the decode loop or step asks which kernel
    runs: the availability checks raise, and the outputs are those of an unpatched run."""
    from decoder import Translator
    torch.set_num_threads(2)
    tr = Translator(MODEL, **kw)
    assert tr.plan.kernels == ops.available()
    want = tr.translate(lines[:12])

    def asked(*a):
        raise AssertionError("the decode step asked whether a kernel is loaded")
    for module, name in ((fused, "_kernel"), (fused, "_cuda_kernels"), (ops, "available"), (ops, "cuda_available")):
        monkeypatch.setattr(module, name, asked)
    assert tr.translate(lines[:12]) == want


def test_settings_line_says_which_ops_run_kernels_and_which_the_reference():
    cpu = resolve(Switches(), device="cpu", beam=1, kernels=BOTH, has_shortlist=False).summary()
    assert cpu.endswith("; kernels: add_norm, attend, encoder_attend, cross_kv, argmax_in_step"), cpu
    beam = resolve(Switches(), device="cpu", beam=4, no_repeat_ngram=3, kernels=BOTH).summary()
    assert "; kernels: " in beam and {"topk", "block"} <= set(beam.split("; kernels: ")[1].split(", "))
    assert "argmax" not in beam  # greedy's
    bare = resolve(Switches(), device="cpu", kernels=NONE, has_shortlist=False).summary()
    assert bare.endswith("; kernels: none; reference: add_norm, attend, argmax_in_step"), bare
    # CUDA: the static state of small batches attends through the decode-step kernel (graph_attention),
    # the eager state of large ones writes its cache and attends through it too; without the kernels
    # their references
    cuda = resolve(Switches(), device="cuda", kernels=BOTH).summary("fp16")
    assert cuda.endswith("; kernels: add_norm, attend, argmax_in_step"), cuda
    assert resolve(Switches(), device="cuda", kernels=Kernels(True, False)).summary("fp16").endswith(
        "; kernels: none; reference: add_norm, attend, argmax_in_step")
    assert "; kernels: none" in resolve(Switches(**opt.all_off()), kernels=BOTH).summary()
    # the shortlist's candidates: the C++ op on CPU, the reference on CUDA (no kernel there)
    assert "shortlist" in resolve(Switches(shortlist=True), kernels=BOTH).summary().split("; kernels: ")[1]
    # on CUDA the graphs take precedence over a shortlist; without graphs it runs, through its reference
    assert resolve(Switches(cuda_graphs=False), device="cuda", kernels=BOTH).summary("fp16").endswith(
        "; reference: shortlist")


# -- batch sizes, per device ---------------------------------------------------------------------

def test_batch_defaults_per_device():
    assert (max_tokens_for(1), max_sentences_for(1)) == (MAX_TOKENS, MAX_SENTENCES)
    assert (max_tokens_for(4), max_sentences_for(4)) == (BEAM_MAX_TOKENS, MAX_SENTENCES)
    assert (max_tokens_for(1, "cuda"), max_sentences_for(1, "cuda")) == (GPU_MAX_TOKENS, GPU_MAX_SENTENCES)
    assert (max_tokens_for(4, "cuda:1"), max_sentences_for(4, "cuda")) == (16384, 2048)  # 16k: measured at beam 4
    assert max_tokens_for(64, "cuda") >= 256 and max_sentences_for(64, "cuda") >= 16


def test_an_explicit_batch_size_wins_on_every_device():
    for device in ("cpu", "cuda"):
        o = Options.make(beam=4, max_tokens=999, max_sentences=7).for_device(device)
        assert (o.max_tokens, o.max_sentences) == (999, 7)
    o = Options.make(beam=4).for_device("cuda")
    assert (o.max_tokens, o.max_sentences) == (max_tokens_for(4, "cuda"), max_sentences_for(4, "cuda"))


def test_help_says_the_batch_defaults_of_each_device(capsys):
    from decoder.__main__ import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for n in (MAX_TOKENS, BEAM_MAX_TOKENS, GPU_MAX_TOKENS, MAX_SENTENCES, GPU_MAX_SENTENCES):
        assert str(n) in text


# -- the device-style loops: host reads counted, outputs unchanged --------------------------------

def translate_counting(lines, batch: int, **kw):
    """Outputs, and (steps, host reads) per batch of `batch` sentences."""
    from decoder import Translator
    tr = Translator(MODEL, **kw)
    steps = [0]

    @contextlib.contextmanager
    def phase(name):
        steps[0] += name == "decode steps"
        yield
    tr.phase = phase
    srcs = [s for s in tr.text.encode(lines) if s is not None]
    out, counts = [], []
    for i in range(0, len(srcs), batch):
        hostsync.reset()
        steps[0] = 0
        out += tr.translate_ids(srcs[i:i + batch])
        counts.append((steps[0], hostsync.total()))
    return out, counts


@pytest.fixture(scope="module")
def lines():
    with open(SRC, encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in fh][:40]


@trained
@pytest.mark.parametrize("kw,extra", [(dict(beam=1), 1), (dict(beam=4), 2), (dict(beam=2, static_shapes=True), 2)])
def test_device_loop_reads_once_per_few_steps_and_gives_the_same_tokens(lines, kw, extra):
    torch.set_num_threads(2)
    every = 8
    per_step, step_counts = translate_counting(lines, 16, **kw)
    device, counts = translate_counting(lines, 16, sync_every=every, **kw)
    assert device == per_step
    for steps, reads in counts:  # one read per `every` steps, the outputs' reads once per batch
        assert reads <= math.ceil(steps / every) + extra, (steps, reads)
    assert all(reads >= steps for steps, reads in step_counts)  # the per-step loop: a read every step


@trained
def test_device_loop_shrinks_the_batch_at_its_reads(lines, monkeypatch):
    from decoder import state as cache
    kept = []
    keep = cache.DecoderState.keep
    monkeypatch.setattr(cache.DecoderState, "keep", lambda self, s, r: (kept.append(s.numel()), keep(self, s, r)))
    device, _ = translate_counting(lines, 24, sync_every=4, beam=1)
    assert kept, "no early stop happened: the test would not see one"
    kept.clear()
    beam, _ = translate_counting(lines, 24, sync_every=4, beam=4)
    assert kept
    assert device == translate_counting(lines, 24, beam=1)[0] and beam == translate_counting(lines, 24, beam=4)[0]


def test_host_reads_are_counted_per_kind():
    hostsync.reset()
    t = torch.tensor([3, 1])
    assert hostsync.to_list(t, "a") == [3, 1] and hostsync.item(t[0], "a") == 3
    assert hostsync.to_cpu(t, "b").tolist() == [3, 1]
    assert dict(hostsync.counts) == {"a": 2, "b": 1} and hostsync.total() == 3
    hostsync.reset()
    assert hostsync.total() == 0


class FakeState:
    """A decoder state whose logits (rows, V) depend only on each row's sentence, its last
    token and the step (a fixed random table), so the picks cannot depend on which
    other sentences share the batch: the two loops must agree exactly."""
    can_shrink, static, graphs, kept, one_row = True, False, False, False, False

    def __init__(self, B: int, K: int, C: int = 11, eos: int = 2, seed: int = 0, T: int = 17):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(B, 11, C, generator=g)  # (sentence, last token id, column)
        self.end = torch.randint(1, 14, (B,), generator=g).float()  # when </s> starts to win
        self.sent, self.eos_col = torch.arange(B).repeat_interleave(K), eos if C == 11 else 1
        self.columns, self.positions = C, T

    def step(self, tokens, t, best=False):
        logits = self.table[self.sent, tokens].clone()  # (rows, V)
        logits[:, self.eos_col] += 3.0 * (t - self.end[self.sent])
        return logits.argmax(-1) if best else logits

    def reorder(self, rows):
        self.sent = self.sent[rows]

    def keep(self, sents, rows):
        self.sent = self.sent[rows]


@pytest.mark.parametrize("beam,ngram,shortlist", [(1, 0, False), (1, 2, False), (1, 0, True), (3, 0, False),
                                                  (4, 2, False), (2, 0, True)])
@pytest.mark.parametrize("every", [2, 8])
def test_device_loops_agree_with_the_per_step_loops_and_read_every_few_steps(beam, ngram, shortlist, every):
    B, V = 13, 11
    vocab = torch.tensor([0, 2, 3, 5, 6, 7, 8, 10]) if shortlist else None  # </s> (2) among the candidates
    lims = [1 + (3 * b) % 17 for b in range(B)]  # a limit of 1 forces </s> at the first step
    runs = {}
    for sync in (1, every):
        plan = resolve(Switches(), beam=beam, kernels=Kernels(cpu=False, cuda=False), sync_every=sync,
                       no_repeat_ngram=ngram)
        s = plan.searcher(start_id=0, eos_id=2, pad_id=1, beam=beam, no_repeat_ngram=ngram)
        state = FakeState(B, beam, V if vocab is None else len(vocab))
        steps = [0]
        step = state.step
        state.step = lambda *a, **k: (steps.__setitem__(0, steps[0] + 1), step(*a, **k))[1]
        hostsync.reset()
        got = search.Outputs.of(plan.search(state, torch.tensor(lims), s, lims, vocab)).result()
        runs[sync] = got, steps[0], hostsync.total()
    (want, steps1, reads1), (got, steps, reads) = runs[1], runs[every]
    assert got == want and all(isinstance(x, int) for row in got for x in row)
    assert reads <= math.ceil(steps / every) + (1 if beam == 1 else 2) + (2 if shortlist and beam > 1 else 0)
    assert reads1 >= steps1  # the per-step loop: at least one read a step
    assert steps < steps1 + every  # the late reads cost at most every-1 extra steps


@trained
@pytest.mark.parametrize("beam", [1, 4])
def test_device_loop_hands_its_outputs_over_unread(lines, beam):
    """The outputs' copy is queued at the end of the loop and read where they are used
    (the text pipeline's thread), so the host can go on to the next batch."""
    from decoder import Translator
    tr = Translator(MODEL, precision="fp32", sync_every=8, beam=beam)
    srcs = [s for s in tr.text.encode(lines[:12]) if s is not None]
    hostsync.reset()
    outputs = tr.start_ids(srcs)
    assert outputs.finish is not None  # nothing made of them yet
    assert hostsync.counts["outputs"] == (1 if beam == 1 else 2)  # queued: counted once, when queued
    assert outputs.result() == Translator(MODEL, precision="fp32", beam=beam).translate_ids(srcs)
    assert outputs.result() is outputs.result()


def test_later_keeps_a_cpu_tensor_and_counts_one_read():
    hostsync.reset()
    t = torch.tensor([[4, 2], [7, 1]])
    got = hostsync.later(t, "outputs")
    assert got.tolist() == [[4, 2], [7, 1]] and hostsync.total() == 1


def test_later_gives_each_row_up_to_its_first_stop_token():
    t = torch.tensor([[5, 6, 2, 7, 2], [2, 0, 0, 0, 0], [9, 8, 7, 6, 5], [4, 2, 2, 2, 2]])
    rows = hostsync.later(t, "outputs").until(2)
    assert rows == [[5, 6], [], [9, 8, 7, 6, 5], [4]]  # a row without one: all of it
    assert all(type(x) is int for row in rows for x in row)


def test_later_on_cuda_queues_a_pinned_copy_and_waits_for_it_only_when_read(monkeypatch):
    """The CUDA branch against stand-ins: a non-blocking copy into pinned memory, an event
    recorded behind it, and the event waited for at the read, not before."""
    log = []

    class Host:
        def __init__(self, shape, dtype=None, pin_memory=False):
            log.append(("empty", tuple(shape), pin_memory))

        def copy_(self, src, non_blocking=False):
            log.append(("copy", non_blocking))

        def tolist(self):
            log.append(("read",))
            return [1]

    class Event:
        def __init__(self, blocking=False):
            log.append(("event", blocking))

        def record(self, stream=None):
            log.append(("record", stream))

        def synchronize(self):
            log.append(("wait",))
    src = SimpleNamespace(device=SimpleNamespace(type="cuda", index=1), shape=(2, 3), dtype=torch.long)
    monkeypatch.setattr(torch, "empty", Host)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    got = hostsync.later(src, "outputs")
    # queued, not waited for; the event behind the copy on the tensor's GPU, whichever is current
    assert log == [("empty", (2, 3), True), ("copy", True), ("event", True), ("record", ("stream of", src.device))]
    assert got.tolist() == [1] and log[4:] == [("wait",), ("read",)]


def test_inputs_go_to_a_gpu_through_pinned_memory_without_waiting(monkeypatch):
    log = []

    class Host:
        def pin_memory(self):
            log.append("pin")
            return self

        def to(self, device, non_blocking=False):
            log.append((str(device), non_blocking))
            return self
    t = Host()
    assert hostsync.to_device(t, "cuda:0") is t and log == ["pin", ("cuda:0", True)]
    cpu = torch.tensor([1, 2])
    assert hostsync.to_device(cpu, "cpu") is cpu


# -- one decision: `resolve` picks the loop and the state, nothing after it ------------------------

def decoder_sources() -> dict:
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "decoder")
    return {n: open(os.path.join(here, n), encoding="utf-8").read() for n in os.listdir(here) if n.endswith(".py")}


def test_resolve_is_the_only_place_that_picks_the_loop_and_the_state():
    import dataclasses
    src = decoder_sources()
    # the searches and the states take what was resolved: neither sees the registry
    for name in ("search.py", "state.py"):
        assert "optimisations" not in code_tokens(src[name]), name
    assert "plan" not in code_tokens(src["search.py"])  # a Search of resolved values and functions
    switches = {o.name for o in opt.OPTIMISATIONS}
    assert not switches & {f.name for f in dataclasses.fields(search.Search)}
    # the states read the resolved StateOptions and the functions the step calls, no switch
    calls = {f.name for f in dataclasses.fields(opt.Plan) if f.type in ("Callable", "Callable | None")}
    code = code_tokens(src["state.py"])
    assert {b for a, dot, b in zip(code, code[1:], code[2:]) if a == "plan" and dot == "."} <= {"states"} | calls
    # the loops are named where resolve binds them; the state classes where new_state builds them
    loops, states = {"greedy", "beam", "greedy_one", "greedy_or_one"}, {
        "IncrementalCache", "RowTableCache", "StaticCache", "OneRowCache"}
    for name, text in src.items():
        code = code_tokens(text)
        if name not in ("optimisations.py", "search.py"):
            named = {b for a, dot, b in zip(code, code[1:], code[2:]) if a == "search" and dot == "."}
            imported = {n.strip() for line in text.splitlines() if line.startswith("from .search import")
                        for n in line.split("import", 1)[1].split(",")}
            assert not (named | imported) & loops and not {"greedy_one", "greedy_or_one"} & set(code), name
        if name != "state.py":
            assert not states & set(code), name


def code_tokens(text: str) -> list[str]:
    """The names and operators of Python source, its comments and strings left out."""
    import io
    import tokenize
    return [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]
