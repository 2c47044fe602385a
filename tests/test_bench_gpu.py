"""tools/bench_gpu.py without a GPU: the sweep, the best rows, the summary's keys and ratios from
fake rows, the GPU-busy arithmetic, the table, the refusal without CUDA and --help."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from decoder import graphs
from tools import bench_gpu
from tools.bench import SUMMARY_RATIOS


def row(group, engine, batch, wps):
    return {"group": group, "engine": engine, "batch": batch, "src_words_per_s": wps, "seconds": 1.0,
            "bleu": 20.0, "chrf": 40.0}


ROWS = [row("throughput", "ours fp16", None, 20_000), row("throughput", "ours fp16", 32768, 120_000),
        row("throughput", "ours fp16", 65536, 110_000),
        row("throughput", "ct2 float16", 32768, 60_000), row("throughput", "ct2 int8_float16", 32768, 50_000),
        row("throughput", "hf fp16", 256, 30_000),
        row("beam4", "ours fp16", 8192, 26_000), row("beam4", "ct2 float16", 4096, 13_000),
        row("beam4", "ct2 int8_float16", 4096, 17_000),
        row("batch1", "ours fp16", 1, 1_000), row("batch1", "ct2 float16", 1, 2_000),
        {"group": "throughput", "engine": "ct2 float16", "batch": 65536, "error": "out of memory"}]


def test_sweep_records_every_size_and_stops_at_the_first_out_of_memory():
    seen = []

    def run(size):
        seen.append(size)
        if size == 4:
            raise RuntimeError("CUDA failed with error out of memory")
        return {"src_words_per_s": size * 10.0}
    rows = bench_gpu.sweep(run, [1, 2, 4, 8])
    assert seen == [1, 2, 4]  # larger sizes would only need more memory
    assert rows == [{"batch": 1, "src_words_per_s": 10.0}, {"batch": 2, "src_words_per_s": 20.0},
                    {"batch": 4, "error": "out of memory"}]


def test_sweep_raises_errors_that_are_not_out_of_memory():
    def run(size):
        raise ValueError("bad model")
    with pytest.raises(ValueError):
        bench_gpu.sweep(run, [1, 2])


def test_best_row_per_engine_skips_failed_rows_and_groups_compute_types():
    assert bench_gpu.best(ROWS, "throughput", "ours")["batch"] == 32768
    assert bench_gpu.best(ROWS, "throughput", "ct2")["engine"] == "ct2 float16"  # either compute type
    assert bench_gpu.best(ROWS, "beam4", "ct2")["engine"] == "ct2 int8_float16"
    assert bench_gpu.best(ROWS, "beam4", "ct2 float16")["src_words_per_s"] == 13_000
    assert bench_gpu.best(ROWS, "batch1", "hf") is None


def test_summary_has_the_cpu_bench_keys_and_ratios_of_the_best_rows():
    s = bench_gpu.summary(ROWS, 0.42, {"gpu": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11"}})
    assert set(SUMMARY_RATIOS.values()) <= set(s)
    assert s["device"] == "cuda" and s["gpu"] == "NVIDIA H100 80GB HBM3" and s["gpu_busy"] == 0.42
    assert s["src_words_per_s"] == 120_000  # our best throughput row, not the default-batch row
    assert s["throughput_vs_ct2_best"] == 2.0
    assert s["beam4_vs_ct2"] == round(26_000 / 17_000, 3)  # against CT2's best compute type
    assert s["batch1_vs_ct2"] == 0.5
    assert s["vs_ct2_float16"]["beam4"] == 2.0
    assert json.loads(json.dumps(s)) == s


def test_summary_without_a_ct2_row_has_no_ratio():
    s = bench_gpu.summary([r for r in ROWS if not r["engine"].startswith("ct2")], None, {})
    assert s["throughput_vs_ct2_best"] is None and s["src_words_per_s"] == 120_000


def test_gpu_busy_is_the_union_of_kernel_intervals_over_the_wall():
    assert bench_gpu.union_length([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25  # overlaps count once
    assert bench_gpu.busy_fraction([(0, 10), (5, 15), (20, 30)], 100) == 0.25
    assert bench_gpu.busy_fraction([(0, 200)], 100) == 1.0
    assert bench_gpu.busy_fraction([], 100) == 0.0 and bench_gpu.busy_fraction([(0, 1)], 0) == 0.0


def test_the_pass_idle_time_splits_into_before_between_and_after_the_kernels():
    # a pass of 100 ms (in us): kernels at 10-30 ms (overlapping) and 50-80 ms, one running past the end
    ms = 1000
    parts = bench_gpu.idle_parts([(10 * ms, 20 * ms), (15 * ms, 30 * ms), (50 * ms, 80 * ms), (95 * ms, 130 * ms)],
                                 0, 100 * ms)
    assert parts == {"idle_before_s": 0.01, "idle_between_s": 0.035, "idle_after_s": 0.0}
    assert bench_gpu.idle_parts([(10 * ms, 20 * ms), (50 * ms, 80 * ms)], 0, 100 * ms)["idle_after_s"] == 0.02
    assert bench_gpu.idle_parts([], 0, 100 * ms) == {"idle_before_s": 0.1, "idle_between_s": 0.0, "idle_after_s": 0.0}


def test_kernel_shares_rank_the_kernels_by_gpu_time():
    events = [("flash_fwd", 0, 30), ("gemm", 30, 40), ("flash_fwd", 40, 70), ("norm", 70, 75), ("gemm", 75, 80)]
    top = bench_gpu.kernel_shares(events, n=2)
    assert top == [{"kernel": "flash_fwd", "calls": 2, "us": 60.0, "share": 0.75},
                   {"kernel": "gemm", "calls": 2, "us": 15.0, "share": 0.1875}]
    assert bench_gpu.kernel_shares([]) == []


def test_the_profile_goes_to_the_log_in_one_line():
    events = [("flash_fwd", 0.0, 30.0), ("gemm", 30.0, 40.0), ("flash_fwd", 40.0, 50.0)]
    prof = {"batch": 65536, "gpu_busy": 0.4213, "kernels": 25218, "top_kernels": bench_gpu.kernel_shares(events)}
    assert bench_gpu.profile_line(prof) == ("profile    ours fp16 batch    65536: GPU busy 42%, 25,218 kernels; "
                                            "80% flash_fwd, 20% gemm")
    prof.update(steps=160, rows=[4096], row_steps=655360)  # the fixed-shape greedy loop's blocks, counted
    assert bench_gpu.profile_line(prof) == ("profile    ours fp16 batch    65536: GPU busy 42%, 25,218 kernels, "
                                            "160 greedy steps of 4096 rows; 80% flash_fwd, 20% gemm")
    prof.update(idle_before_s=0.041, idle_between_s=0.0123, idle_after_s=0.002)
    assert bench_gpu.profile_line(prof) == (
        "profile    ours fp16 batch    65536: GPU busy 42%, 25,218 kernels, 160 greedy steps of 4096 rows; "
        "GPU idle in the profiled pass: 41 ms before its first kernel, 12 ms between kernels, 2 ms after its last; "
        "80% flash_fwd, 20% gemm")
    prof.update(host_wall_s=0.74, host_phases={"encode": {"first_s": 0.095, "last_s": 0.5, "inside_s": 0.02},
                                               "decode steps": {"first_s": 0.102, "last_s": 0.699, "inside_s": 0.3}})
    assert bench_gpu.profile_line(prof).endswith(
        "2 ms after its last; unprofiled, the host first encoded at 95 ms of 740, stepped 102-699 ms; "
        "80% flash_fwd, 20% gemm")


def test_the_timeline_keeps_each_phases_first_entry_last_exit_and_time_inside():
    clock = FakeClock()
    tl = bench_gpu.Timeline(clock)
    for start, end, name in ((0.1, 0.2, "encode"), (0.2, 0.5, "decode steps"), (0.6, 0.9, "decode steps")):
        clock.t = start
        with tl.phase(name):
            clock.t = end
    assert tl.summary() == {"encode": {"first_s": 0.1, "last_s": 0.2, "inside_s": 0.1},
                            "decode steps": {"first_s": 0.2, "last_s": 0.9, "inside_s": 0.6}}
    assert tl.seconds == pytest.approx({"encode": 0.1, "decode steps": 0.6})  # tools.bench's phase table


def test_the_host_timeline_of_a_pass_orders_its_phases_and_gives_the_hook_back(tiny_translator):
    tr, lines = tiny_translator

    def go(ls):
        return tr.translate(ls)
    go.translator = tr
    t = bench_gpu.host_timeline(go, lines)
    ph = t["host_phases"]
    assert 0 < ph["encode"]["first_s"] <= ph["decode steps"]["first_s"] < ph["decode steps"]["last_s"] \
        <= t["host_wall_s"]
    assert 0 < ph["decode steps"]["inside_s"] <= ph["decode steps"]["last_s"] - ph["decode steps"]["first_s"]
    assert "phase" not in vars(tr) and tr.phase("encode") is not None  # the class's hook, unchanged


def test_table_marks_each_engines_best_and_says_ct2_is_not_profiled():
    s = bench_gpu.summary(ROWS, 0.42, {})
    prof = {"batch": 32768, "gpu_busy": 0.42, "kernel_s": 1.0, "wall_s": 2.4, "busy_under_profiler": 0.3,
            "kernels": 1000}
    md = bench_gpu.to_markdown(ROWS, s, prof, "head")
    assert "GPU time by kernel" not in md  # a profile without them (older JSON)
    prof["top_kernels"] = [{"kernel": "flash_fwd", "calls": 2, "us": 6000.0, "share": 0.75}]
    md = bench_gpu.to_markdown(ROWS, s, prof, "head")
    assert "| `flash_fwd` | 2 | 6.0 | 75% |" in md
    assert "| ours fp16 | 32768 | **120,000** | 2.00 |" in md
    assert "| ours fp16 | default | 20,000 | 0.33 |" in md
    assert "| ct2 float16 | 65536 | out of memory |" in md
    assert "GPU busy" in md and "42%" in md and "torch.profiler does not see" in md
    assert "throughput_vs_ct2_best 2.0" in md
    assert "greedy steps" not in md
    prof.update(steps=500, rows=[4096], row_steps=2048000)
    assert "1,000 kernels; 500 greedy steps of 4096 rows, 2.00 ms of kernels a step)" in \
        bench_gpu.to_markdown(ROWS, s, prof, "head")


def test_the_beam_profile_has_lines_of_its_own_beside_the_throughput_ones():
    s = bench_gpu.summary(ROWS, 0.42, {})
    beam = {"batch": 32768, "gpu_busy": 0.61, "kernel_s": 0.4, "wall_s": 0.62, "busy_under_profiler": 0.5,
            "kernels": 900, "loop": "beam", "steps": 120, "rows": [1724, 2276], "row_steps": 233376,
            "top_kernels": [{"kernel": "log_softmax_topk", "calls": 120, "us": 9000.0, "share": 0.3}]}
    prof = {"batch": 65536, "gpu_busy": 0.42, "kernel_s": 1.0, "wall_s": 2.4, "busy_under_profiler": 0.3,
            "kernels": 1000, "beam4": beam}
    md = bench_gpu.to_markdown(ROWS, s, prof, "head")
    assert "ours at its best throughput row (batch 65536): 42%" in md
    assert ("ours at its best beam-4 row (batch 32768): 61% (0.40 s of CUDA kernels in a 0.62 s pass; 50% of the "
            "profiled pass, 900 kernels; 120 beam steps of 1724/2276 rows, 3.33 ms of kernels a step)") in md
    assert "GPU time by kernel, that beam-4 row" in md and "| `log_softmax_topk` | 120 | 9.0 | 30% |" in md
    assert md.count("torch.profiler does not see") == 1
    only = bench_gpu.to_markdown(ROWS, bench_gpu.summary(ROWS, None, {}), {"beam4": beam}, "head")  # throughput's left out
    assert "best beam-4 row" in only and "best throughput row" not in only
    assert bench_gpu.profile_line(beam, "beam4").startswith(
        "profile    ours fp16 beam4 batch    32768: GPU busy 61%, 900 kernels, 120 beam steps of 1724/2276 rows")


def test_a_cuda_run_profiles_our_best_throughput_and_beam_rows(monkeypatch):
    import argparse
    clock = FakeClock()
    fake_engines(monkeypatch, clock, {("ours fp16", g): 1.0 for g in ("throughput", "beam4", "batch1")})
    monkeypatch.setattr(bench_gpu, "GROUPS", ("throughput", "beam4", "batch1"))
    monkeypatch.setattr(bench_gpu, "SWEEPS", {g: {"ours": (1, 2)} for g in ("throughput", "beam4", "batch1")})
    seen = []

    def profiled(eng, src, rows, deadline, log, group="throughput"):
        seen.append((group, len(src)))
        return {"batch": 1, "gpu_busy": 0.5 if group == "throughput" else 0.7}
    monkeypatch.setattr(bench_gpu, "profiled", profiled)
    src = [f"a b c {i}" for i in range(6)]
    a = argparse.Namespace(model="m", engines=["ours"], passes=1, beam_lines=3, batch1_lines=1, ablate=[],
                           chunked=0, time_limit=None)
    _, prof = bench_gpu.run_all(a, src, src, lambda m: None, device="cuda", clock=clock)
    assert seen == [("throughput", 6), ("beam4", 3)]  # each on its group's lines
    assert prof["gpu_busy"] == 0.5 and prof["beam4"] == {"batch": 1, "gpu_busy": 0.7}


def test_every_engine_has_a_sweep_in_every_group():
    for g in ("throughput", "beam4", "batch1"):
        for e in bench_gpu.ENGINES:
            sizes = bench_gpu.SWEEPS[g][e]
            rest = [s for s in sizes if s is not None]
            assert rest == sorted(rest) and len(set(sizes)) == len(sizes), (g, e)
    assert [n for n, _ in bench_gpu.engine_list(["ours", "ct2", "hf"])] == \
        ["ours fp16", "ct2 float16", "ct2 int8_float16", "hf fp16"]
    assert [n for n, _ in bench_gpu.engine_list(["ours", "ct2"], ["float16"])] == ["ours fp16", "ct2 float16"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda_in_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.bench_gpu", "--model", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "CUDA" in lines[0]


def test_help_and_an_unknown_engine(capsys):
    with pytest.raises(SystemExit) as e:
        bench_gpu.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--engines" in out and "(default: ours,ct2,hf)" in out
    with pytest.raises(SystemExit) as e:
        bench_gpu.parse_args(["--model", "x", "--engines", "ours,marian"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "unknown engine 'marian'" in err[-1]
    assert bench_gpu.parse_args(["--model", "x", "--ablate", "cuda_graphs, graph_reuse,sync_every=4"]).ablate == [
        "cuda_graphs", "graph_reuse", "sync_every=4"]
    assert bench_gpu.parse_args(["--model", "x"]).ct2_types == ["float16", "int8_float16"]
    assert bench_gpu.parse_args(["--model", "x", "--ct2-types", "float16"]).ct2_types == ["float16"]
    for bad, says in ((["--ablate", "warp_speed"], "unknown switch 'warp_speed'"),
                      (["--ablate", "cuda_graphs,block=4"], "unknown setting 'block'; the settings are sync_every"),
                      (["--ablate", "sync_every=0"], "sync_every=0: "),
                      (["--ablate", "sync_every=four"], "sync_every=four: "),
                      (["--ct2-types", "float16,int4"], "--ct2-types: choose from float16, int8_float16"),
                      (["--ablate", "cuda_graphs", "--engines", "ct2"], "--ablate needs ours")):
        with pytest.raises(SystemExit) as e:
            bench_gpu.parse_args(["--model", "x", *bad])
        assert e.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]


def test_every_engine_runs_its_sweep_on_cpu(tmp_path, monkeypatch):
    """run_all on CPU with one size a sweep: the code path a GPU run takes (loading, the sweep,
    BLEU, the rows), minus CUDA; CTranslate2 where installed (transformers is left out: its import
    alone takes seconds, and its loader is tools.bench's on CPU)."""
    import argparse
    from fixture_model import make_model_dir, synthetic_corpus
    engines = ["ours"] + (["ct2"] if __import__("importlib").util.find_spec("ctranslate2") else [])
    model = make_model_dir(tmp_path / "model", seed=4)
    lines = synthetic_corpus(6, seed=2)
    monkeypatch.setattr(bench_gpu, "SWEEPS", {g: {e: sizes[:1] if g != "throughput" or e != "ours" else (None, 512)
                                                  for e, sizes in by.items()} for g, by in bench_gpu.SWEEPS.items()})
    monkeypatch.setattr(bench_gpu, "GROUPS", ("throughput", "batch1"))  # beam 4 is the same code, another beam
    a = argparse.Namespace(model=str(model), engines=engines, passes=1, beam_lines=4, batch1_lines=2,
                           ablate=["fast_normaliser", "fused_norm", "sync_every=2"], chunked=2, processes=0,
                           ct2_types=["float16"])  # int8_float16: one more compute type string
    loaded, load = [], bench_gpu.ours_go
    monkeypatch.setattr(bench_gpu, "ours_go", lambda *args, **kw: loaded.append(kw) or load(*args, **kw))
    rows, prof = bench_gpu.run_all(a, lines, lines, lambda m: None, device="cpu")
    assert prof is None
    assert sum(kw.get("sync_every") == 2 for kw in loaded) == 2  # the setting's rows loaded with it
    names = {r["engine"] for r in rows}
    assert "ours fp16" in names and all(r["src_words_per_s"] > 0 for r in rows)
    assert all(r["row_s"] >= r["seconds"] for r in rows)  # each row's whole time, loading and warm-up too
    # --ablate: each switch flipped from its default (fast_normaliser, fused_norm), and a setting,
    # a row at our best throughput and batch-1 sizes, never taken for ours' best
    for label in ("without fast_normaliser", "without fused_norm", "sync_every=2"):
        ablated = [r for r in rows if r["engine"] == f"{bench_gpu.ABLATION} {label}"]
        assert [(r["group"], r["batch"]) for r in ablated] == [
            ("throughput", bench_gpu.best(rows, "throughput", "ours")["batch"]), ("batch1", 1)]
    # --chunked: ours at that size with the text in chunks of 2 lines, by default and with two switches off
    top = bench_gpu.best(rows, "throughput", "ours")
    chunked = [(r["engine"], r["batch"], r["lines"]) for r in rows if "chunks of" in r["engine"]]
    assert chunked == [(f"{bench_gpu.ABLATION} chunks of 2 lines{x}", top["batch"], 6)
                       for x in ("", ", without short_gil_interval", ", without decode_ahead")]
    assert all(bench_gpu.best(rows, g, "ours")["engine"] == "ours fp16" for g in ("throughput", "batch1"))
    assert [r["batch"] for r in rows if r["group"] == "throughput" and r["engine"] == "ours fp16"] == [None, 512]
    assert {r["lines"] for r in rows if r["group"] == "batch1"} == {2}
    if "ct2" in engines:
        assert "ct2 float16" in names and "ct2 int8_float16" not in names
        # its sweep in one call with one cap, then its other ways at that size; batch 1 a sentence a call
        ct2 = [(r["group"], r.get("how"), r["batch"]) for r in rows if r["engine"] == "ct2 float16"]
        size = bench_gpu.SWEEPS["throughput"]["ct2"][0]
        assert ct2 == [("throughput", "one cap", size), *(("throughput", how, size) for how, _ in bench_gpu.CT2_WAYS),
                       ("batch1", None, 1)]
        assert all(r["src_words_per_s"] > 0 and r["bleu"] >= 0 for r in rows if r["engine"] == "ct2 float16")
    s = bench_gpu.summary(rows, None, {})
    assert s["src_words_per_s"] == bench_gpu.best(rows, "throughput", "ours")["src_words_per_s"]


def test_each_row_warms_up_on_every_line_before_its_timed_passes(monkeypatch):
    """A warm-up of 8 lines left a GPU row's first timed pass cold (its batch shapes' memory and
    kernel plans): every row first runs the whole set once."""
    import argparse
    calls = []

    class Loaded:
        def __enter__(self):
            return lambda ls: calls.append(len(ls)) or list(ls)

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(bench_gpu, "Engines", lambda *a: None)
    monkeypatch.setattr(bench_gpu, "engine_list", lambda engines, types=None: [("ours fp16", lambda e, g, s: Loaded())])
    monkeypatch.setattr(bench_gpu, "GROUPS", ("throughput",))
    monkeypatch.setattr(bench_gpu, "SWEEPS", {"throughput": {"ours": (512,)}})
    src = [f"a b c {i}" for i in range(20)]
    a = argparse.Namespace(model="m", engines=["ours"], passes=2, beam_lines=1, batch1_lines=1, ablate=[], chunked=0)
    bench_gpu.run_all(a, src, src, lambda m: None, device="cpu")
    assert calls == [20, 20, 20]


def test_a_row_whose_graph_capture_failed_says_it_ran_eagerly():
    """On the H200 (2026-11-26) every greedy and beam row after a failed capture ran eagerly and
    the table did not say so: a row records it and the table names it."""
    from types import SimpleNamespace

    def go(ls):
        return list(ls)
    lines = ["a b c", "d e"]
    for failed in (False, True):
        go.translator = SimpleNamespace(model=SimpleNamespace(graphs_failed=failed, captures=graphs.Tally()))
        r = {**row("throughput", "ours fp16", 32768, 1), **bench_gpu.timed(go, lines, lines, 1)}
        assert r.get("graphs_failed", False) is failed
        rows = [r, *ROWS[1:]]
        md = bench_gpu.to_markdown(rows, bench_gpu.summary(rows, None, {}), None, "head")
        assert ("| ours fp16 (graph capture failed: eager) | 32768 |" in md) is failed


def test_a_row_reports_the_graphs_its_fastest_timed_pass_captured():
    """The warm-up pass captures too; a row says what a timed pass cost the host in captures."""
    import time
    from types import SimpleNamespace
    calls = iter([(5, 0.5, 0.0), (3, 0.3, 0.08), (2, 0.2, 0.04)])  # warm-up (fastest of all), slow, fast

    def go(ls):
        n, sec, wait = next(calls)
        for _ in range(n):
            go.translator.model.captures.add(sec / n)
        time.sleep(wait)
        return list(ls)
    go.translator = SimpleNamespace(model=SimpleNamespace(graphs_failed=False, captures=graphs.Tally()))
    lines = ["a b c", "d e"]
    r = {**row("throughput", "ours fp16", 32768, 1), **bench_gpu.timed(go, lines, lines, 2)}
    assert (r["captures"], r["capture_s"]) == (2, 0.2)
    rows = [r, *ROWS[1:]]
    md = bench_gpu.to_markdown(rows, bench_gpu.summary(rows, None, {}), None, "head")
    assert f"| {r['bleu']:.2f} | {r['chrf']:.2f} | 2 (0.200) |" in md
    assert "| ct2 float16 | 32768 | **60,000** | 1.00 | 20.00 | 40.00 |  |" in md  # other engines: blank


@pytest.fixture(scope="module")
def tiny_translator():
    """(the fixed-shape greedy loop on CPU, the fixture's first 60 test lines)."""
    import os

    from decoder import Translator
    model = os.path.join(os.path.dirname(__file__), "fixtures", "bible-tiny", "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        pytest.skip("trained fixture tests/fixtures/bible-tiny is absent")
    tr = Translator(model, static_shapes=True, sync_every=4, max_tokens=1024, max_sentences=64)
    with open(os.path.join(os.path.dirname(model), "test.en"), encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh][:60]
    with tr:
        yield tr, lines


def test_the_profiled_pass_counts_the_beam_steps_it_ran(monkeypatch, tiny_translator):
    import os
    import warnings

    from decoder import Translator
    _, lines = tiny_translator
    model = os.path.join(os.path.dirname(__file__), "fixtures", "bible-tiny", "model")
    beam = Translator(model, beam=4, static_shapes=True, max_tokens=1024,
                      max_sentences=16)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA the profiler says it profiles none
        prof = bench_gpu.profile_busy(beam.translate, lines[:20], 1.0)
    assert prof["loop"] == "beam" and prof["steps"] > 0 and set(prof["rows"]) <= {4 * n for n in range(1, 17)}
    assert prof["row_steps"] >= prof["steps"] * min(prof["rows"])


def test_the_profiled_pass_counts_the_greedy_steps_it_ran(monkeypatch, tiny_translator):
    """On CPU the profiler sees no kernels, but the fixed-shape loop's blocks are counted the same."""
    import warnings
    tr, lines = tiny_translator
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA the profiler says it profiles none
        prof = bench_gpu.profile_busy(tr.translate, lines, 1.0)
    assert prof["steps"] > 0 and prof["steps"] % 4 == 0  # blocks of sync_every steps, a state per batch
    assert sum(prof["rows"]) <= 60 and min(prof["rows"]) > 0
    assert prof["idle_before_s"] > 0 and prof["idle_between_s"] == prof["idle_after_s"] == 0  # no kernels on CPU
    assert min(prof["rows"]) * prof["steps"] <= prof["row_steps"] <= max(prof["rows"]) * prof["steps"]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_row_starts_only_where_the_slowest_of_its_group_would_end_in_time():
    clock = FakeClock()
    d = bench_gpu.Deadline(10.0, clock)
    ours, ours_b1 = bench_gpu.slot("throughput", "ours fp16"), bench_gpu.slot("batch1", "ours fp16")
    assert d.allows(ours)  # nothing timed yet
    with d.timing(ours):
        clock.t += 4.0
    assert d.allows(ours) and d.allows(ours_b1)  # 4 + 4 < 10
    clock.t = 6.5
    assert not d.allows(ours) and d.allows(ours_b1)  # 6.5 + 4 past 10; batch 1 untimed
    clock.t = 10.0
    assert not d.allows(ours_b1)  # the time is up for every group
    with pytest.raises(bench_gpu.TimeUp):
        d.check(ours_b1)
    assert bench_gpu.Deadline(None, clock).allows(ours, 100.0)  # no limit: everything runs


def test_ours_extra_rows_are_estimated_from_ours_rows_not_a_slower_engines():
    """H200, 2026-11-27: CTranslate2's first throughput row (27 s with its conversion) left out every
    ablation row of ours (7 s each) under the group's slowest row."""
    clock = FakeClock()
    d = bench_gpu.Deadline(10.0, clock)
    with d.timing(bench_gpu.slot("throughput", "ct2 float16")):
        clock.t += 6.0
    with d.timing(bench_gpu.slot("throughput", "ours fp16")):
        clock.t += 1.0
    assert d.allows(bench_gpu.slot("throughput", f"{bench_gpu.ABLATION} without cuda_graphs"))  # 7 + 1
    assert d.allows(bench_gpu.slot("throughput", f"{bench_gpu.ABLATION} chunks of 5000 lines"))
    assert not d.allows(bench_gpu.slot("throughput", "ct2 float16"))  # 7 + 6
    assert bench_gpu.slot("throughput", "ct2 float16") != bench_gpu.slot("throughput", "ct2 int8_float16")


def test_sweep_records_the_sizes_the_time_limit_leaves_out():
    def run(size):
        if size > 2:
            raise bench_gpu.TimeUp
        return {"src_words_per_s": size * 10.0}
    made = []
    rows = bench_gpu.sweep(run, [1, 2, 4, 8], each=made.append)
    assert rows == made == [{"batch": 1, "src_words_per_s": 10.0}, {"batch": 2, "src_words_per_s": 20.0},
                            {"batch": 4, "error": bench_gpu.NOT_RUN}, {"batch": 8, "error": bench_gpu.NOT_RUN}]


def fake_engines(monkeypatch, clock, seconds: dict) -> None:
    """Engines (named as in seconds' keys) whose rows take seconds[engine, group] on clock, half in the
    warm-up pass and half in the timed one."""
    class Loaded:
        def __init__(self, took):
            self.took = took

        def __enter__(self):
            def go(ls):
                clock.t += self.took / 2
                return list(ls)
            return go

        def __exit__(self, *exc):
            return None

    class Eng:
        def __init__(self, *a):
            pass

        def ours(self, group, size, **switches):
            return Loaded(seconds["ours fp16", group])
    names = list(dict.fromkeys(name for name, _ in seconds))
    monkeypatch.setattr(bench_gpu, "Engines", Eng)
    monkeypatch.setattr(bench_gpu, "engine_list", lambda engines, types=None: [
        (name, lambda e, g, s, name=name, **how: Loaded(seconds[name, g])) for name in names])


def test_a_time_limited_run_writes_every_row_as_it_goes_and_records_the_rows_left_out(monkeypatch):
    """A lent GPU's call has a hard limit: rows that would pass --time-limit are recorded as not run,
    the others written after each row, so the files hold what was measured whenever the run stops."""
    import argparse
    clock = FakeClock()
    fake_engines(monkeypatch, clock, {("ours fp16", "throughput"): 3.0, ("ours fp16", "batch1"): 0.25})
    monkeypatch.setattr(bench_gpu, "GROUPS", ("throughput", "batch1"))
    monkeypatch.setattr(bench_gpu, "SWEEPS", {"throughput": {"ours": (1, 2, 3, 4, 5)}, "batch1": {"ours": (1,)}})
    src = [f"a b c {i}" for i in range(4)]
    a = argparse.Namespace(model="m", engines=["ours"], passes=1, beam_lines=1, batch1_lines=2,
                           ablate=["fast_normaliser"], chunked=0, time_limit=10.0)
    written = []
    rows, prof = bench_gpu.run_all(a, src, src, lambda m: None, device="cpu", clock=clock,
                                   write=lambda rows, prof: written.append([r.get("error") for r in rows]))
    # throughput rows at 0, 3 and 6 s end by 9; the fourth would end at 12; batch 1 (0.25 s) still fits at 9,
    # and its ablation row at 9.25; the throughput ablation row does not
    top = bench_gpu.best(rows, "throughput", "ours")["batch"]
    assert [(r["group"], r["batch"], r.get("error")) for r in rows] == [
        ("throughput", 1, None), ("throughput", 2, None), ("throughput", 3, None),
        ("throughput", 4, bench_gpu.NOT_RUN), ("throughput", 5, bench_gpu.NOT_RUN), ("batch1", 1, None),
        ("throughput", top, bench_gpu.NOT_RUN), ("batch1", 1, None)]
    assert len(written) == len(rows) and written[-1] == [r.get("error") for r in rows]
    assert [len(w) for w in written] == list(range(1, len(rows) + 1))  # one write a row
    assert prof is None


def test_a_time_limited_run_still_runs_our_ablation_rows_after_a_slower_engines_rows(monkeypatch):
    import argparse
    clock = FakeClock()
    fake_engines(monkeypatch, clock, {("ours fp16", "throughput"): 1.0, ("ct2 float16", "throughput"): 6.0})
    monkeypatch.setattr(bench_gpu, "GROUPS", ("throughput",))
    monkeypatch.setattr(bench_gpu, "SWEEPS", {"throughput": {"ours": (1, 2), "ct2": (1,)}})
    src = [f"a b c {i}" for i in range(4)]
    a = argparse.Namespace(model="m", engines=["ours", "ct2"], passes=1, beam_lines=1, batch1_lines=1,
                           ablate=["fast_normaliser"], chunked=0, time_limit=12.0)
    rows, _ = bench_gpu.run_all(a, src, src, lambda m: None, device="cpu", clock=clock)
    # ours 0-1 and 1-2 s, CTranslate2 2-8 s; the ablation row of ours (1 s) fits at 8 where CTranslate2's
    # other ways (6 s each) do not
    assert [(r["engine"], r.get("how"), r.get("error")) for r in rows] == [
        ("ours fp16", None, None), ("ours fp16", None, None), ("ct2 float16", "one cap", None),
        *(("ct2 float16", how, bench_gpu.NOT_RUN) for how, _ in bench_gpu.CT2_WAYS),
        (f"{bench_gpu.ABLATION} without fast_normaliser", None, None)]


def test_a_beam_switchs_ablation_rows_are_beam_rows_and_the_others_throughput_and_batch1_rows(monkeypatch):
    import argparse
    clock = FakeClock()
    fake_engines(monkeypatch, clock, {("ours fp16", g): 1.0 for g in ("throughput", "beam4", "batch1")})
    monkeypatch.setattr(bench_gpu, "GROUPS", ("throughput", "beam4", "batch1"))
    monkeypatch.setattr(bench_gpu, "SWEEPS", {g: {"ours": (1,)} for g in ("throughput", "beam4", "batch1")})
    src = [f"a b c {i}" for i in range(4)]
    a = argparse.Namespace(model="m", engines=["ours"], passes=1, beam_lines=2, batch1_lines=1,
                           ablate=["kv_row_table", "fast_normaliser"], chunked=0, time_limit=None)
    rows, _ = bench_gpu.run_all(a, src, src, lambda m: None, device="cpu", clock=clock)
    assert [(r["group"], r["engine"]) for r in rows if r["engine"].startswith(bench_gpu.ABLATION)] == [
        ("beam4", f"{bench_gpu.ABLATION} without kv_row_table"),
        ("throughput", f"{bench_gpu.ABLATION} without fast_normaliser"),
        ("batch1", f"{bench_gpu.ABLATION} without fast_normaliser")]


def test_the_files_say_partial_until_the_run_ends(tmp_path, monkeypatch):
    """A run stopped mid-way (the call's limit) leaves its rows so far in PREFIX.json and .md, marked."""
    src = tmp_path / "s.txt"
    src.write_text("a b\nc d\n")
    first = row("throughput", "ours fp16", 512, 1_000)

    def stopped(a, s, r, log, write):
        write([first], None)
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_gpu, "check", lambda a: None)
    monkeypatch.setattr(bench_gpu, "run_all", stopped)
    out = tmp_path / "gpu"
    with pytest.raises(KeyboardInterrupt):
        bench_gpu.main(["--model", f"{ROOT}/tests/fixtures/bible-tiny/model", "--src", str(src), "--ref", str(src),
                        "--out", str(out), "--summary", str(tmp_path / "summary.json")])
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["complete"] is False and record["rows"] == [first]
    assert bench_gpu.PARTIAL in (tmp_path / "gpu.md").read_text()
    assert not (tmp_path / "summary.json").exists()  # the summary is the finished run's


def test_an_ablation_entry_flips_switches_or_sets_settings_together(monkeypatch):
    assert bench_gpu.ablation("fast_normaliser") == ("without fast_normaliser", {"fast_normaliser": False})
    assert bench_gpu.ablation("sync_every = 4") == ("sync_every=4", {"sync_every": 4})
    assert bench_gpu.ablation("kv_row_table+sync_every=16") == (
        "without kv_row_table + sync_every=16", {"kv_row_table": False, "sync_every": 16})
    off = dataclasses.replace(bench_gpu.BY_NAME["kv_row_table"], default=False)  # a switch off by default
    monkeypatch.setitem(bench_gpu.BY_NAME, "kv_row_table", off)
    assert bench_gpu.ablation("kv_row_table") == ("with kv_row_table", {"kv_row_table": True})
    for bad in ("sync_every=", "sync_every=-1", "warp_speed=2", "warp_speed", "kv_row_table+",
                "sync_every=2+sync_every=4"):
        with pytest.raises(ValueError):
            bench_gpu.ablation(bad)


def test_ctranslate2_rows_take_one_cap_unless_a_way_says_otherwise(monkeypatch):
    """On a GPU CTranslate2 ran in our caps' calls (93 of about 80 sentences for 10,000 lines), so
    its swept batch sizes hardly changed its batches: its sweep runs the whole input in one call."""
    runs, text = [], []
    monkeypatch.setattr(bench_gpu, "ct2_translator", lambda ct2_dir, model, run, device, text_processes: (
        runs.append(run), text.append(text_processes)) and None)
    monkeypatch.setattr("decoder.pipeline.os.sched_getaffinity", lambda pid: set(range(16)))
    eng = bench_gpu.Engines("m", "w", device="cuda")
    eng._ct2 = "ct2-dir"
    loaders = dict(bench_gpu.engine_list(["ct2"], ["float16"]))
    loaders["ct2 float16"](eng, "throughput", 32768)
    loaders["ct2 float16"](eng, "beam4", 8192, **dict(bench_gpu.CT2_WAYS)["caps as ours"])
    loaders["ct2 float16"](eng, "throughput", 16384, **dict(bench_gpu.CT2_WAYS)["one cap, inter_threads 4"])
    loaders["ct2 float16"](eng, "batch1", 1)
    assert [(r.compute_type, r.beam, r.max_batch_size, r.one_cap, r.inter_threads, r.batch1) for r in runs] == [
        ("float16", 1, 32768, True, 1, False), ("float16", 4, 8192, False, 1, False),
        ("float16", 1, 16384, True, 4, False), ("float16", 1, 1, False, 1, True)]
    assert text == [8] * 4  # the normaliser processes ours runs on a 16-core GPU machine
    assert bench_gpu.Engines("m", "w", device="cpu").text_processes() == 0  # as ours on a CPU


class AtSpeed:
    """A loaded engine whose rows measure `wps` words/s (with `measured` patched to AtSpeed.measured)."""

    def __init__(self, wps):
        self.wps = wps

    def __enter__(self):
        return lambda ls: list(ls)

    def __exit__(self, *exc):
        return None

    @staticmethod
    def measured(deadline, where, loaded, s, r, passes):
        return {"src_words_per_s": loaded.wps, "seconds": 1.0, "bleu": 1.0, "chrf": 1.0, "row_s": 1.0}


def test_ctranslate2s_other_ways_run_at_its_best_size_and_may_be_its_best(monkeypatch):
    import argparse
    speed = {(None, 1024): 10.0, (None, 2048): 20.0, ("caps as ours", 2048): 8.0,
             ("caps as ours, inter_threads 4", 2048): 12.0, ("one cap, inter_threads 2", 2048): 30.0,
             ("one cap, inter_threads 4", 2048): 25.0}
    ways = {tuple(sorted(kw.items())): how for how, kw in bench_gpu.CT2_WAYS}

    def load(e, g, s, **how):
        return AtSpeed(speed[ways.get(tuple(sorted(how.items()))), s])

    monkeypatch.setattr(bench_gpu, "Engines", lambda *a: None)
    monkeypatch.setattr(bench_gpu, "engine_list", lambda engines, types=None: [("ct2 float16", load)])
    monkeypatch.setattr(bench_gpu, "GROUPS", ("throughput",))
    monkeypatch.setattr(bench_gpu, "SWEEPS", {"throughput": {"ct2": (1024, 2048)}})
    monkeypatch.setattr(bench_gpu, "measured", AtSpeed.measured)
    src = ["a b", "c d"]
    a = argparse.Namespace(model="m", engines=["ct2"], passes=1, beam_lines=1, batch1_lines=1, ablate=[], chunked=0)
    rows, _ = bench_gpu.run_all(a, src, src, lambda m: None, device="cpu")
    assert [(r.get("how"), r["batch"], r["src_words_per_s"]) for r in rows] == [
        ("one cap", 1024, 10.0), ("one cap", 2048, 20.0), ("caps as ours", 2048, 8.0),
        ("caps as ours, inter_threads 4", 2048, 12.0), ("one cap, inter_threads 2", 2048, 30.0),
        ("one cap, inter_threads 4", 2048, 25.0)]
    top = bench_gpu.best(rows, "throughput", "ct2")
    assert top["how"] == "one cap, inter_threads 2"  # the denominator of the ratio
    ours = row("throughput", "ours fp16", 65536, 60.0)
    assert bench_gpu.summary([*rows, ours], None, {})["throughput_vs_ct2_best"] == 2.0
    md = bench_gpu.to_markdown([*rows, ours], bench_gpu.summary([*rows, ours], None, {}), None, "head")
    assert "| ct2 float16 (one cap, inter_threads 2) | 2048 | **30** | 1.00 |" in md
    assert "| ct2 float16 (caps as ours) | 2048 | 8 | 0.27 |" in md


def test_ours_in_several_processes_gives_the_one_process_lines_in_order(tmp_path):
    """--processes: the lines in shares, one a spawned process, joined in input order."""
    import os

    from fixture_model import make_model_dir, synthetic_corpus

    from tools.bench import ours_go
    model = make_model_dir(tmp_path / "model", seed=4)
    lines = synthetic_corpus(9, seed=2) + ["", "a b c"]
    with ours_go(str(model), 1, False, device="cpu", precision="fp32") as go:
        want = go(lines)
    procs = bench_gpu.Engines(str(model), str(tmp_path), device="cpu").ours_processes("throughput", None, 2)
    with procs as go:
        assert go(lines) == want
        assert go(lines[:1]) == want[:1]  # fewer lines than processes
        pids = {p.submit(os.getpid).result() for p in procs.pools}
        assert len(pids) == 2 and os.getpid() not in pids
    assert procs.pools == []  # shut down on exit


def test_the_processes_row_runs_at_ours_best_throughput_size_and_is_never_ours_best(monkeypatch):
    import argparse
    loaded = []

    class Eng:
        def __init__(self, *a):
            pass

        def ours_processes(self, group, size, n):
            loaded.append((group, size, n))
            return AtSpeed(50.0)
    monkeypatch.setattr(bench_gpu, "Engines", Eng)
    monkeypatch.setattr(bench_gpu, "engine_list", lambda engines, types=None: [
        ("ours fp16", lambda e, g, s: AtSpeed({None: 10.0, 2048: 20.0}[s]))])
    monkeypatch.setattr(bench_gpu, "GROUPS", ("throughput",))
    monkeypatch.setattr(bench_gpu, "SWEEPS", {"throughput": {"ours": (None, 2048)}})
    monkeypatch.setattr(bench_gpu, "measured", AtSpeed.measured)
    src = ["a b", "c d"]
    for n, rows_made in ((2, 3), (1, 2), (0, 2)):
        loaded.clear()
        a = argparse.Namespace(model="m", engines=["ours"], passes=1, beam_lines=1, batch1_lines=1, ablate=[],
                               chunked=0, processes=n)
        rows, _ = bench_gpu.run_all(a, src, src, lambda m: None, device="cpu")
        assert len(rows) == rows_made and loaded == ([("throughput", 2048, 2)] if n == 2 else [])
        assert bench_gpu.best(rows, "throughput", "ours")["src_words_per_s"] == 20.0
    assert bench_gpu.parse_args(["--model", "x"]).processes == 2
    # a child that cannot load is that row's result, and the run goes on
    def cannot_load(self, group, size, n):
        raise RuntimeError("CUDA error: out of resources\nmore")
    monkeypatch.setattr(Eng, "ours_processes", cannot_load)
    a.processes = 2
    rows, _ = bench_gpu.run_all(a, src, src, lambda m: None, device="cpu")
    assert rows[-1]["error"] == "failed: CUDA error: out of resources"
    assert bench_gpu.parse_args(["--model", "x", "--engines", "ct2"]).processes == 0


def test_an_extra_row_out_of_gpu_memory_is_recorded_and_the_run_goes_on():
    """CTranslate2 with inter_threads 4 holds four batches at once: one more than its sweep's row."""
    class Loaded:
        def __init__(self, error):
            self.error = error

        def __enter__(self):
            raise self.error

        def __exit__(self, *exc):
            return None
    rec, d = bench_gpu.Record(), bench_gpu.Deadline(None)
    lines = (["a b"], ["a b"])
    how = "one cap, inter_threads 4"
    got = bench_gpu.extra_row(rec, d, "throughput", "ct2 float16", 8192, lines, 1,
                              Loaded(RuntimeError("CUDA failed with error out of memory")), how=how)
    assert got is None and rec.rows == [{"group": "throughput", "engine": "ct2 float16", "how": how, "lines": 1,
                                         "words": 2, "batch": 8192, "error": "out of memory"}]
    with pytest.raises(ValueError):
        bench_gpu.extra_row(rec, d, "throughput", "ct2 float16", 8192, lines, 1, Loaded(ValueError("bad model")))
