"""The registry of optimisations (decoder/optimisations.py): one entry per switch,
resolved once into the Plan the decode step calls; everything that lists the
switches (CLI, README, benchmarks) is generated from it."""
import dataclasses
import os

import pytest

from decoder import optimisations as opt
from decoder.translator import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# what `resolve` decides from the device, the beam and the loaded kernels, not from one switch
RESOLVED = {"device", "loop", "every", "kernels", "runs", "ops", "bound", "states", "search"}
# the slots that choose the state and its options: `resolve` turns them into Plan.states
IN_STATES = {"cuda_graphs", "static_keep", "static_attend", "kv_row_table", "one_row",
             "one_row_layer", "one_row_step"}


def test_every_plan_slot_is_filled_by_a_registry_entry():
    slots = {o.slot for o in opt.OPTIMISATIONS}
    assert slots - IN_STATES == {f.name for f in dataclasses.fields(opt.Plan)} - RESOLVED
    assert IN_STATES <= slots


NEEDS = {"fused_project_argmax": {"softmax_free": True}, "fused_log_softmax": {"fused_topk": True},
         "int8_gemv": {"fbgemm_int8": True},
         "int8_vnni_int_mm": {"fbgemm_int8": True}, "int8_packed_gemm": {"fused_ops": True},
         "graph_reuse": {"cuda_graphs": True},  # it keeps the CUDA-graph state
         "kv_row_table": {"fused_attention": True},
         "normalise_processes": {"fast_normaliser": True},
         "graph_attention": {"cuda_graphs": True, "fused_attention": True},
         "one_row_layer": {"one_row": True, "fused_norm": True, "fused_qkv": True},
         "one_row_step": {"one_row": True, "fused_norm": True, "fused_qkv": True, "one_row_layer": True,
                          "fused_project_argmax": True, "softmax_free": True}}
# switches resolved elsewhere than their bench group's device at batch 1
WHERE = {"kv_row_table": dict(beam=4)}  # the CPU's beam state


def test_each_switch_alone_changes_only_its_own_slot(monkeypatch):
    monkeypatch.setattr(opt, "fbgemm_available", lambda: True)
    monkeypatch.setattr(opt, "int_mm_vnni", lambda: True)  # a VNNI CPU, whatever this one is
    for o in opt.OPTIMISATIONS:
        off = {**opt.all_off(), **NEEDS.get(o.name, {})}
        # each on the device it has kernels for, with every kernel loaded
        where = {"device": "cuda" if o.bench == "cuda" else "cpu", "kernels": opt.Kernels(cpu=True, cuda=True),
                 **WHERE.get(o.name, {})}
        base = opt.resolve(opt.Switches(**off), no_repeat_ngram=0, **where)
        plan = opt.resolve(opt.Switches(**{**off, o.name: True}), no_repeat_ngram=0, **where)
        changed = {f.name for f in dataclasses.fields(plan) if getattr(plan, f.name) != getattr(base, f.name)}
        if o.slot in IN_STATES:  # the state and its options, and with them the loop
            assert "states" in changed and changed - {"runs", "bound"} <= {"states", "search"}, o.name
            assert plan.runs - base.runs == {o.name}, o.name
            continue
        assert changed - {"runs", "bound"} == {o.slot}, o.name
        on = o.on.bind(plan.ops) if isinstance(o.on, opt.Bound) else o.on  # fused ops: bound to the device's
        assert getattr(plan, o.slot) is on and plan.runs - base.runs == {o.name}


def test_a_switch_whose_needs_fail_keeps_the_reference(monkeypatch):
    on = opt.Switches(fused_project_argmax=True)
    assert opt.resolve(on, no_repeat_ngram=0).argmax_in_step
    assert not opt.resolve(on, no_repeat_ngram=2).argmax_in_step  # n-gram blocking needs the logits
    assert opt.resolve(opt.Switches(fused_topk=False, fused_log_softmax=True), no_repeat_ngram=0).topk is None
    for vnni, kernel in ((True, "int_mm"), (False, "fbgemm")):  # int8_vnni_int_mm needs a VNNI _int_mm
        monkeypatch.setattr(opt, "int_mm_vnni", lambda: vnni)
        assert opt.resolve(opt.Switches(), no_repeat_ngram=0).int8_kernel == kernel


def test_switches_default_to_the_registry_and_refuse_unknown_names():
    assert dataclasses.asdict(Options().switches) == {o.name: o.default for o in opt.OPTIMISATIONS}
    o = Options.make(beam=4, fused_norm=True)
    assert o.beam == 4 and o.switches.fused_norm and Options.make(**o.flat()) == o
    with pytest.raises(TypeError):
        Options.make(fused_everything=True)


def test_decoder_readme_switch_table_is_the_registrys():
    readme = open(os.path.join(ROOT, "decoder", "README.md")).read()
    table = readme.split("<!-- switches:begin -->\n")[1].split("\n<!-- switches:end -->")[0]
    assert table == opt.table_markdown()


def test_benchmark_rows_cover_every_measurable_switch():
    from tools.bench import ablation, batch1_rows, beam_rows
    from tools.bench_fused import rows
    cumulative, variants = ablation()
    listed = cumulative + variants + beam_rows({"precision": "fp32"}) + batch1_rows({"precision": "fp32"})
    named = {k for _, kw in listed for k, v in kw.items() if v is True}
    greedy, beam = rows()
    named |= {k for kw in list(greedy.values()) + list(beam.values()) for k, v in kw.items() if v is True}
    measurable = {o.name for o in opt.OPTIMISATIONS if o.bench not in ("ngram", "cuda")}
    assert measurable <= named


def test_batch1_rows_end_with_the_int8_kernels_the_throughput_winner_left_off():
    from tools.bench import batch1_rows
    batch1 = {o.name for o in opt.group("batch1")}
    # the AVX-512 winner of 2026-11-25: our _int_mm C++ linear, fbgemm and the gemv kernel off
    rows = batch1_rows({"precision": "int8", "fused_ops": True, "fbgemm_int8": False, "int8_gemv": False})
    last = rows[-1][1]
    assert all(last[n] for n in batch1) and last["fbgemm_int8"] and last["int8_gemv"]
    assert not any(rows[0][1][n] for n in batch1)
    fp32 = batch1_rows({"precision": "fp32"})[-1][1]
    assert "int8_gemv" not in fp32 and all(fp32[n] for n in batch1)


def test_composed_bench_row_is_the_fastest_precision_with_the_kernels_that_paid_alone():
    from tools.bench import ablation, compose
    cumulative, variants = ablation()
    plain = cumulative[-1]
    speed = {plain[0]: 100.0, "+ bf16 weights and activations": 120.0, "+ int8 dynamic (PyTorch ops)": 150.0,
             "+ fused decode-step attention (C++)": 110.0, "+ fused bias+residual+LayerNorm (C++)": 90.0}
    measured = {n: (speed.get(n, 50.0), kw) for n, kw in cumulative + variants}
    name, kw = compose(measured, plain[1])
    fastest_int8 = max((r for r in measured.values() if r[1]["precision"] == "int8"), key=lambda r: r[0])[1]
    assert kw["precision"] == "int8" and kw == {**fastest_int8, "fused_attention": True}
    assert not kw["fused_norm"] and "fused_attention" in name
    assert compose({n: r for n, r in measured.items() if n != plain[0]}, plain[1]) is None


def test_defaults_bench_row_is_the_shipped_decoder_at_the_cpus_default_precision(monkeypatch):
    from tools import bench
    for prec in ("int8", "fp32"):
        monkeypatch.setattr(bench, "default_precision", lambda device, p=prec: p)
        name, kw = bench.defaults_row()
        assert kw["precision"] == prec and kw["beam"] == 1 and name.endswith(prec)
        assert all(kw[o.name] == o.default for o in opt.OPTIMISATIONS)
