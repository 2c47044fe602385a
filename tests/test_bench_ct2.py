"""The benchmark's CTranslate2 side (tools/baselines.py, tools/bench.py): CT2 run as its
performance guide says, vmap from our shortlist, our caps per sentence, summary.json."""
import json
import os
from dataclasses import asdict
import shutil
import subprocess

import pytest
import torch

from decoder import Translator, modeldir
from tools import baselines, bench
from tools.baselines import VMAP, CT2Run, cap_groups, ct2_runs, ct2_translator, write_vmap
from tools.convert import max_decoding_length, to_ctranslate2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "fixtures", "bible-tiny")
MODEL = os.path.join(DATA, "model")
TEST_SET = ["--src", os.path.join(DATA, "test.en"), "--ref", os.path.join(DATA, "test.es")]
AVX512 = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"]


@pytest.fixture(scope="module")
def lines():
    return bench.read(os.path.join(DATA, "test.en"))[:20]  # line 12 runs into its length cap


@pytest.fixture(scope="module")
def shortlisted(tmp_path_factory):
    """The trained fixture with a small shortlist: each source token's 5 best target ids."""
    from student.shortlist.build import add_to_model_dir
    torch.set_num_threads(1)
    d = str(tmp_path_factory.mktemp("sl") / "model")
    shutil.copytree(MODEL, d)
    add_to_model_dir(d, os.path.join(DATA, "test.en"), os.path.join(DATA, "test.es"), k=5, n_frequent=10)
    return d


@pytest.fixture(scope="module")
def ct2_dir(shortlisted, tmp_path_factory):
    return to_ctranslate2(shortlisted, str(tmp_path_factory.mktemp("ct2") / "ct2"))


# -- the configurations -------------------------------------------------------------------------

@pytest.mark.parametrize("group,beam", [("throughput", 1), ("beam4", 4)])
def test_ct2_throughput_runs_are_the_guides_int8_workers_on_token_batches(group, beam):
    runs = ct2_runs(group, 4, max_tokens=2048)
    assert runs[0] == CT2Run("int8", beam, inter_threads=4, intra_threads=1, max_batch_size=2048,
                             batch_type="tokens")
    assert CT2Run("int8", beam, inter_threads=1, intra_threads=4, max_batch_size=2048) in runs  # the other way
    assert not any(r.use_vmap or r.batch1 for r in runs)
    # per-sentence caps everywhere but in the one row that shows CT2's plain one-cap use
    assert [r for r in runs if r.one_cap] == [CT2Run("int8", beam, inter_threads=4, max_batch_size=2048, one_cap=True)]


def test_ct2_batch1_run_is_one_thread_one_sentence_a_call():
    assert ct2_runs("batch1", 8) == [CT2Run("int8", 1, inter_threads=1, intra_threads=1, batch1=True)]


def test_every_ct2_run_has_a_vmap_twin_when_our_rows_use_the_shortlist():
    for g in bench.GROUPS:
        plain, runs = ct2_runs(g, 2), ct2_runs(g, 2, vmap=True)
        assert ([r for r in runs if r.use_vmap and not r.one_cap]
                == [CT2Run(**{**r.__dict__, "use_vmap": True}) for r in plain if not r.one_cap])


# -- vmap ------------------------------------------------------------------------------------------

def test_vmap_file_lists_each_source_tokens_shortlist_and_the_always_allowed_ids(shortlisted, tmp_path):
    import sentencepiece as spm
    cfg = modeldir.read_config(shortlisted)
    offsets, ids, frequent = modeldir.read_shortlist(shortlisted, cfg)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(shortlisted, "spm.model"))
    with open(write_vmap(str(tmp_path), shortlisted), encoding="utf-8") as fh:
        got = [line.split("\t") for line in fh.read().splitlines()]
    assert all(len(x) == 2 for x in got)
    table = {s: [sp.piece_to_id(p) for p in t.split()] for s, t in got}
    assert table.pop("") == frequent.tolist() + [cfg.eos_id]
    want = {sp.id_to_piece(s): ids[offsets[s]:offsets[s + 1]].tolist()
            for s in range(cfg.arch.vocab_size) if offsets[s + 1] > offsets[s]}
    assert table == want


def test_ct2_with_the_vmap_translates_as_our_shortlist_does(shortlisted, ct2_dir, lines):
    ours = [Translator(shortlisted, precision="fp32", threads=1, shortlist=True).translate([x])[0] for x in lines]
    full = Translator(shortlisted, precision="fp32", threads=1).translate(lines)
    assert ours != full  # the shortlist changes the output, so the comparison below means something
    go = ct2_translator(ct2_dir, shortlisted, CT2Run("float32", batch1=True, use_vmap=True))
    assert os.path.isfile(os.path.join(ct2_dir, VMAP))
    assert go(lines) == ours


# -- length caps -----------------------------------------------------------------------------------

def test_ct2_caps_each_sentence_as_our_decoder_caps_it(lines):
    tr = Translator(MODEL, precision="fp32", threads=1)
    srcs = tr.text.encode(lines)  # ids with </s>
    groups = cap_groups([s[:-1] for s in srcs], tr.cfg.arch.max_positions)
    cap_of = {i: cap for cap, idx in groups.items() for i in idx}
    assert sorted(cap_of) == list(range(len(lines)))
    ours = tr.limits([len(s) for s in srcs]).tolist()  # steps including </s>
    assert [cap_of[i] for i in range(len(lines))] == [n - 1 for n in ours]


def test_ct2_in_token_batches_on_parallel_workers_gives_our_greedy_output(tmp_path):
    lines = bench.read(os.path.join(DATA, "test.en"))[:70]
    ct2 = to_ctranslate2(MODEL, str(tmp_path / "ct2"))
    tr = Translator(MODEL, precision="fp32", threads=1)
    ours, srcs = tr.translate(lines), tr.text.encode(lines)
    caps = [max_decoding_length(len(s) - 1, tr.cfg.arch.max_positions) for s in srcs]
    # sentences that run into their cap: one cap for all (the longest line's) would let CT2 run on
    assert any(len(tr.text.sp.encode(o)) >= c - 2 and c < max(caps) for o, c in zip(ours, caps))
    go = ct2_translator(ct2, MODEL, CT2Run("float32", inter_threads=2, max_batch_size=64))
    assert go(lines) == ours
    longer = ct2_translator(ct2, MODEL, CT2Run("float32", inter_threads=2, max_batch_size=64, one_cap=True))(lines)
    assert longer != ours  # the one-cap row: the capped sentences run on to the longest line's cap


def test_ct2_with_the_normaliser_in_processes_as_ours_on_a_gpu_gives_the_same_lines(ct2_dir, shortlisted,
                                                                                      monkeypatch):
    from decoder import pipeline
    lines = bench.read(os.path.join(DATA, "test.en"))[:pipeline.POOL_LINES]  # a group the pool takes
    want = ct2_translator(ct2_dir, shortlisted, CT2Run("float32", max_batch_size=256))(lines)
    monkeypatch.setattr(pipeline, "_POOLS", {})  # this test's shared pool, closed at its end
    try:
        assert baselines._text(shortlisted, 2)[1].pool is not None and baselines._text(shortlisted)[1].pool is None
        pooled = ct2_translator(ct2_dir, shortlisted, CT2Run("float32", max_batch_size=256), text_processes=2)
        assert pooled(lines + ["", "  "]) == want + ["", ""]
    finally:
        for p in pipeline._POOLS.values():
            p.close()


# -- ISA passes and summary.json -------------------------------------------------------------------

def test_isa_passes_run_native_here_and_the_capped_family_in_a_child():
    env = {}
    assert bench.isa_passes("native,avx2", AVX512, env) == [("avx512", None), ("avx2", bench.CAPPED["avx2"])]
    assert bench.isa_passes("native,avx2", ["avx2", "fma"], env) == [("avx2", None)]  # AVX2-only CPU: one pass
    assert bench.isa_passes("avx2", AVX512, bench.CAPPED["avx2"]) == [("avx2", None)]  # the capped child itself
    assert bench.CAPPED["avx2"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                    "CT2_FORCE_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
                                    "DECODER_MAX_CPU_ISA": "avx2"}  # our own kernels too
    with pytest.raises(ValueError, match="no AVX-512"):
        bench.isa_passes("avx512", ["avx2"], env)


def test_unknown_isa_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--isa", "sse9", "--skip", "ct2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --isa")


@pytest.mark.parametrize("args, flags, says", [
    (["--skip", "naive,foo"], AVX512, "--skip: unknown name 'foo' (choose from naive, ablation, hf, ct2, batch1,"),
    (["--ct2-isa", "sse9"], AVX512, "--ct2-isa SSE9: not one this CPU runs (GENERIC, AVX, AVX2, AVX512)"),
    (["--ct2-isa", "avx512"], ["avx2", "fma"], "--ct2-isa AVX512: not one this CPU runs (GENERIC, AVX, AVX2)"),
    (["--ref", "SHORT"], AVX512, "lines but --src"),
])
def test_options_the_parser_cannot_check_are_refused_before_any_work(args, flags, says, tmp_path, monkeypatch,
                                                                      capsys):
    (tmp_path / "short.es").write_text("one line\n", encoding="utf-8")
    monkeypatch.setattr(bench, "cpu_info", lambda: {"cpu": "Test CPU", "cores": 2, "flags": flags})
    monkeypatch.setattr(bench, "run_pass", lambda *a: pytest.fail("a pass started"))
    args = [str(tmp_path / "short.es") if x == "SHORT" else x for x in args]
    with pytest.raises(SystemExit) as e:
        bench.main(["--src", os.path.join(DATA, "test.en"), *args, "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_the_interleaved_benches_refuse_a_reference_of_another_length(tmp_path, capsys):
    import argparse
    (tmp_path / "short.es").write_text("one line\n", encoding="utf-8")
    src = os.path.join(DATA, "test.en")
    a = argparse.Namespace(model=MODEL, src=src, ref=str(tmp_path / "short.es"), lines=1)
    with pytest.raises(SystemExit) as e:
        bench.read_test_set(a)  # bench_fused's, bench_gpu's and ablation_gpu's test set
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "short.es has 1 lines but --src" in err[0], err
    assert bench.read_test_set(argparse.Namespace(model=MODEL, src=src, ref=None, lines=2)) == \
        (bench.read(src)[:2], bench.read(os.path.join(DATA, "test.es"))[:2])


def test_summary_goes_into_a_folder_made_for_it(tmp_path, monkeypatch):
    fake_engines(monkeypatch)
    summary = tmp_path / "new" / "ratios.json"
    bench.main([*TEST_SET, "--lines", "2", "--skip", ",".join(bench.SKIPPABLE), "--out", str(tmp_path / "b"),
                "--summary", str(summary)])
    assert [s["isa"] for s in json.load(open(summary))] == [bench.isa_family(bench.cpu_info()["flags"])]


def fake_engines(monkeypatch):
    """Instant engines with known speeds (lines/s), so the bench's bookkeeping is what is tested."""
    def speed_ours(kw):
        s = {"fp32": 100, "int8": 150}.get(kw.get("precision", "fp32"), 50)
        return s * (1.5 if kw.get("workers") else 1) * (1.2 if kw.get("shortlist") else 1) / kw.get("beam", 1)

    def run_ours(model_dir, lines, threads, passes=1, batch1=False, **kw):
        return list(lines), len(lines) / (speed_ours(kw) / (3 if batch1 else 1))

    def run_ct2(ct2_dir, model_dir, lines, run, passes=1):
        s = (200 if run.compute_type == "int8" else 120) * (1.3 if run.inter_threads > 1 else 1)
        return list(lines), len(lines) / (s * (1.1 if run.use_vmap else 1) / run.beam / (4 if run.batch1 else 1))

    def run_head_to_head(model_dir, ct2_dir, lines, ours, run, passes=1):
        # side by side both run slower than alone, ours more: the summary must show it
        threads, batch1, kw = ours
        h2h.append((kw, run))
        (_, o), (_, c) = run_ours(model_dir, lines, threads, batch1=batch1, **kw), run_ct2(ct2_dir, model_dir, lines, run)
        return (list(lines), o / 0.8), (list(lines), c / 0.9)

    h2h = []
    monkeypatch.setattr(bench, "run_ours", run_ours)
    monkeypatch.setattr(bench, "run_ct2", run_ct2)
    monkeypatch.setattr(bench, "run_head_to_head", run_head_to_head)
    monkeypatch.setattr(bench, "to_ctranslate2", lambda model, out: out)
    return h2h


def test_summary_has_one_object_per_isa_with_our_best_over_ct2_best(shortlisted, tmp_path, monkeypatch):
    fake_engines(monkeypatch)
    monkeypatch.setattr(bench, "cpu_info", lambda: {"cpu": "Test CPU", "cores": 2, "flags": AVX512})
    children = []

    real_run = subprocess.run

    def child(cmd, cwd=None, env=None, **kw):  # the capped pass, in this process with its environment
        if cmd[1:3] != ["-m", "tools.bench"]:  # anything else (matplotlib probing the system) runs
            return real_run(cmd, cwd=cwd, env=env, **kw)
        children.append({k: env.get(k) for k in bench.CAPPED["avx2"]})
        with monkeypatch.context() as m:
            for k, v in bench.CAPPED["avx2"].items():
                m.setenv(k, v)
            bench.main(cmd[3:])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", child)
    out = str(tmp_path / "b")
    bench.main(["--model", shortlisted, *TEST_SET, "--lines", "6", "--batch1-lines", "3", "--threads", "2",
                "--skip", "naive,hf,ablation", "--isa", "native,avx2", "--out", out])
    assert children == [bench.CAPPED["avx2"]]
    summary = json.load(open(tmp_path / "summary.json"))
    assert [s["isa"] for s in summary] == ["avx512", "avx2"]
    for s, fam in zip(summary, ("avx512", "avx2")):
        assert set(s) == {"isa", "cpu", "date", "model", "model_shape", "throughput_vs_ct2_best", "batch1_vs_ct2",
                          "beam4_vs_ct2", "our_kernels_isa"}
        rows = json.load(open(f"{out}-{fam}.json"))["rows"]
        # the ISA our own kernels ran, per row of ours (the capped child here shares this process's library)
        assert s["our_kernels_isa"] == bench.our_kernels_isa()
        assert {r["our_kernels_isa"] for r in rows if r["engine"] == "ours"} == {s["our_kernels_isa"]}
        for g, key in bench.SUMMARY_RATIOS.items():
            # the ratio of the group's head-to-head rows, which rerun each engine's best row
            h2h = {r["engine"]: r["src_words_per_s"] for r in rows if r["group"] == g and r.get("h2h")}
            best = lambda e: max(r["src_words_per_s"] for r in rows  # noqa: E731
                                 if r["group"] == g and r["engine"] == e and not r.get("h2h"))
            assert s[key] == round(h2h["ours"] / h2h["ct2"], 3)
            assert abs(h2h["ours"] / h2h["ct2"] - 0.8 / 0.9 * best("ours") / best("ct2")) < 1e-3
        assert s["cpu"] == "Test CPU" and s["model"] == bench.shown_path(shortlisted)
        # which model: its shape and size, never the machine's absolute path to it
        assert not s["model"].startswith("/") and s["model"].endswith("model")
        assert s["model_shape"].startswith("student-tiny: d 128, 4 heads, ffn 512, 3+1 layers, vocab 2000, ")
    png = (tmp_path / "b.png").read_bytes()  # the chart of both passes, beside the tables
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_bench_runs_ct2_as_the_guide_says_with_vmap_beside_our_shortlist_rows(shortlisted, tmp_path, monkeypatch):
    fake_engines(monkeypatch)
    bench.main(["--model", shortlisted, *TEST_SET, "--lines", "6", "--batch1-lines", "3", "--threads", "2",
                "--skip", "naive,hf,ablation", "--out", str(tmp_path / "b"), "--summary", "none"])
    rows = json.load(open(tmp_path / "b.json"))["rows"]
    assert not (tmp_path / "summary.json").exists()
    ct2 = {g: [r["ct2"] for r in rows if r["engine"] == "ct2" and r["group"] == g] for g in bench.GROUPS}
    for g, beam in (("throughput", 1), ("beam4", 4)):
        guide = dict(compute_type="int8", beam=beam, inter_threads=2, intra_threads=1, batch_type="tokens",
                     max_batch_size=4096, batch1=False, one_cap=False)
        assert {**guide, "use_vmap": False} in ct2[g] and {**guide, "use_vmap": True} in ct2[g]
    assert all(c["intra_threads"] == 1 and c["batch1"] for c in ct2["batch1"])
    assert any(c["use_vmap"] for c in ct2["batch1"])
    ours = [r for r in rows if r["engine"] == "ours"]
    assert any(r["shortlist"] for r in ours if r["group"] == "throughput")
    assert all(r["threads"] == 1 for r in ours if r["group"] == "batch1")
    # the shortlist is the decoder's default: each "+ lexical shortlist" row's twin beside it runs without it
    paired = {r["config"] for r in ours if r["config"].endswith(", + lexical shortlist")}
    twins = [r for r in ours if r["config"] + ", + lexical shortlist" in paired]
    assert twins and not any(r["shortlist"] for r in twins) and all(
        r["shortlist"] for r in ours if r["config"] in paired)


def test_head_to_head_reruns_each_groups_best_configurations_only(shortlisted, tmp_path, monkeypatch):
    h2h = fake_engines(monkeypatch)
    bench.main(["--model", shortlisted, *TEST_SET, "--lines", "6", "--batch1-lines", "3", "--threads", "2",
                "--skip", "naive,hf,ablation", "--out", str(tmp_path / "b"), "--summary", "none"])
    rows = json.load(open(tmp_path / "b.json"))["rows"]
    assert len(h2h) == len(bench.GROUPS)
    for g, (kw, run) in zip(bench.GROUPS, h2h):
        timed = [r for r in rows if r["group"] == g and not r.get("h2h")]
        ours = max((r for r in timed if r["engine"] == "ours"), key=lambda r: r["src_words_per_s"])
        ct2 = max((r for r in timed if r["engine"] == "ct2"), key=lambda r: r["src_words_per_s"])
        assert asdict(run) == ct2["ct2"]
        assert (kw.get("workers", 0), bool(kw.get("shortlist")), kw.get("beam", 1)) == \
            (ours["workers"], ours["shortlist"], ours["beam"])
        pair = [r for r in rows if r["group"] == g and r.get("h2h")]
        assert [r["config"] for r in pair] == [f"head to head: {ours['config']}", f"head to head: {ct2['config']}"]
    bench.main(["--model", shortlisted, *TEST_SET, "--lines", "6", "--batch1-lines", "3", "--threads", "2",
                "--skip", "naive,hf,ablation,h2h", "--out", str(tmp_path / "c"), "--summary", "none"])
    assert not any(r.get("h2h") for r in json.load(open(tmp_path / "c.json"))["rows"])


def test_alternating_passes_warm_every_engine_then_take_turns_and_keep_each_fastest(monkeypatch):
    import tools.baselines as tb
    now, lengths = [0.0], iter([5.0, 3.0, 4.0, 9.0, 1.0, 2.0])  # a 5, b 3, a 4, b 9, a 1, b 2
    monkeypatch.setattr(tb.time, "perf_counter", lambda: now[0])
    calls = []

    def engine(name):
        def go(lines):  # a timed pass (all 10 lines) advances the clock by its length
            calls.append((name, len(lines)))
            now[0] += next(lengths) if len(lines) == 10 else 0.0
            return [name] * len(lines)
        return go
    (oa, sa), (ob, sb) = tb.alternating([engine("a"), engine("b")], list(range(10)), passes=3)
    assert calls == [("a", 8), ("b", 8)] + [("a", 10), ("b", 10)] * 3
    assert (sa, sb) == (1.0, 2.0) and oa == ["a"] * 10 and ob == ["b"] * 10


def test_head_to_head_runs_ours_at_its_threads_after_ct2_set_the_shared_openmp_pool(shortlisted, ct2_dir, lines,
                                                                                   monkeypatch):
    seen = []

    class Counting(Translator):  # the thread count each of our passes runs at
        def translate(self, ls):
            seen.append(torch.get_num_threads())
            return super().translate(ls)
    monkeypatch.setattr(bench, "Translator", Counting)
    run, before = CT2Run(compute_type="int8", beam=1, inter_threads=2, intra_threads=1), torch.get_num_threads()
    try:
        (ours, _), (theirs, _) = bench.run_head_to_head(shortlisted, ct2_dir, lines, (2, False, {"precision": "int8"}),
                                                        run, passes=2)
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2, 2] and len(ours) == len(theirs) == len(lines)
