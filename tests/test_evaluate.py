"""submission/evaluate: scores equal the sacreBLEU CLI's, the Pareto frontier, the outputs,
and whole evaluations of a tiny random model (and, marked slow, of the container)."""
import json
import os
import random
import subprocess
import sys

import pytest

from fixture_model import make_model_dir, synthetic_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SACREBLEU = os.path.join(os.path.dirname(sys.executable), "sacrebleu")


def write(path, lines):
    path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return str(path)


def noisy(lines, seed):
    """Hypotheses that overlap the references partly: dropped, swapped and changed words."""
    rng = random.Random(seed)
    out = []
    for x in lines:
        w = x.split()
        if len(w) > 2 and rng.random() < 0.5:
            del w[rng.randrange(len(w))]
        if len(w) > 2 and rng.random() < 0.5:
            i = rng.randrange(len(w) - 1)
            w[i], w[i + 1] = w[i + 1], w[i]
        if rng.random() < 0.3:
            w.append(rng.choice(["casa", "perro.", "«rey»", "ñandú"]))
        out.append(" ".join(w))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaluate")
    model = make_model_dir(d / "model", vocab_size=300, d_model=32, enc=1, dec=1)
    src = synthetic_corpus(16, seed=11)
    ref = synthetic_corpus(16, seed=12)
    return {"dir": d, "model": model, "src": write(d / "test.en", src), "ref": write(d / "test.es", ref),
            "src_lines": src, "ref_lines": ref}


@pytest.mark.parametrize("n_refs", [1, 2])
def test_bleu_and_chrf_equal_the_sacrebleu_cli(tmp_path, n_refs):
    from submission.evaluate.scoring import score
    refs = [synthetic_corpus(60, seed=1 + k) for k in range(n_refs)]
    hyps = noisy(refs[0], seed=9)
    ref_files = [write(tmp_path / f"ref{k}.txt", r) for k, r in enumerate(refs)]
    hyp_file = write(tmp_path / "hyp.txt", hyps)
    cli = subprocess.run([SACREBLEU, *ref_files, "-i", hyp_file, "-m", "bleu", "chrf", "-w", "2", "-f", "json"],
                         capture_output=True, text=True, check=True)
    bleu_cli, chrf_cli = json.loads(cli.stdout)
    ours = score(hyps, refs)
    assert 0 < ours["bleu"] < 100
    assert ours["bleu"] == bleu_cli["score"] and ours["bleu_signature"] == bleu_cli["signature"]
    assert ours["chrf"] == chrf_cli["score"] and ours["chrf_signature"] == chrf_cli["signature"]


def test_pareto_frontier_keeps_exactly_the_undominated_points():
    from submission.evaluate.scoring import pareto_frontier
    pts = [(50, 31.0),   # 0 slowest, best: on it
           (100, 30.0),  # 1 on it
           (150, 25.0),  # 2 beaten by 3
           (200, 28.0),  # 3 beaten by 4: same BLEU, slower
           (300, 28.0),  # 4 on it
           (400, 20.0),  # 5 on it
           (400, 19.0),  # 6 beaten by 5: same speed, lower BLEU
           (100, 30.0)]  # 7 a copy of 1: only the first copy counts
    assert pareto_frontier(pts) == [0, 1, 4, 5]
    assert pareto_frontier([]) == []
    assert pareto_frontier([(10, 1.0)]) == [0]


def summary(label, engine, wps, bleu, spread=0.1, model_mb=10.0, **kw):
    return {"system": label, "engine": engine, "mode": "throughput", "src_words_per_s": wps, "bleu": bleu,
            "src_words_per_s_min": wps * (1 - spread), "src_words_per_s_max": wps * (1 + spread), "repeats": 3,
            "model_mb": model_mb, **kw}


CHART_ROWS = [
    summary("teacher beam 4", "decoder", 40.0, 31.0, model_mb=40.0),
    summary("student int8", "decoder", 900.0, 28.5, spread=0.2, model_mb=5.0),
    summary("student CT2 int8", "ct2", 1100.0, 28.4, model_mb=5.5),
    summary("student HF", "hf", 120.0, 28.5),
    summary("container CPU-1 (student)", "container", 500.0, 28.5, name="student",
            config={"engine": "container", "hardware": "CPU-1", "cpus": 1.0}),
    summary("container CPU-ALL (student)", "container", 700.0, 28.5, name="student",
            config={"engine": "container", "hardware": "CPU-ALL", "cpus": 2.0}),
    {**summary("broken", "hf", 0, None), "error": "x"}]
HW = {"cpu": "AMD EPYC", "isa": "AVX2", "flags": ["avx2", "fma"], "cores": 2, "threads": 2, "date": "2026-11-24",
      "versions": {"torch": "2.5.1", "ctranslate2": "4.5.0", "sacrebleu": "2.4.0"}}
TESTSET = {"name": "newstest2019", "src_lang": "en", "tgt_lang": "de", "lines": 1997}


def test_chart_title_names_test_set_and_pair_and_the_machine_its_isa_threads_versions_date():
    from submission.evaluate.report import chart_data
    d = chart_data(CHART_ROWS, HW, TESTSET)
    assert "newstest2019" in d["title"] and "en→de" in d["title"]
    for part in ("AMD EPYC", "AVX2", "2 threads", "torch 2.5.1", "ctranslate2 4.5.0", "2026-11-24"):
        assert part in d["machine"], (part, d["machine"])
    no_pair = chart_data(CHART_ROWS, HW, {**TESTSET, "src_lang": None})
    assert "language pair not given" in no_pair["title"]


def test_chart_points_carry_min_max_whiskers_model_size_and_the_container_track():
    from submission.evaluate.report import chart_data, marker_area
    d = chart_data(CHART_ROWS, HW, TESTSET)
    pts = {p["system"]: p for p in d["points"]}
    assert "broken" not in pts  # a failed system has no point
    s = pts["student int8"]
    assert (s["x_min"], s["x"], s["x_max"]) == pytest.approx((720.0, 900.0, 1080.0))
    assert pts["container CPU-1 (student)"]["label"] == "container CPU-1, 1 CPU (student)"
    assert pts["container CPU-ALL (student)"]["label"] == "container CPU-ALL, 2 CPU (student)"
    assert [p["system"] for p in d["points"] if p["on_frontier"]] == \
        ["teacher beam 4", "student int8", "student CT2 int8"]
    # marker area grows with the model: the 40 MB teacher's is the largest
    areas = {k: marker_area(p["model_mb"], 40.0) for k, p in pts.items()}
    assert max(areas, key=areas.get) == "teacher beam 4" and areas["student int8"] < areas["student CT2 int8"]


def test_pareto_png_is_written(tmp_path):
    from submission.evaluate.report import chart_data, plot_pareto
    path = tmp_path / "pareto.png"
    plot_pareto(chart_data(CHART_ROWS, HW, TESTSET), str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_default_precisions_put_ours_and_ct2_int8_on_the_chart(tiny, tmp_path):
    from submission.evaluate.__main__ import build_systems, parse_args
    systems, _ = build_systems(parse_args(["--model", tiny["model"], "--engines", "decoder,ct2", "--threads", "2"]))
    assert {(s.engine, s.precision) for s in systems} >= {("decoder", "int8"), ("ct2", "int8")}


def test_cuda_asked_for_without_one_is_said_once_and_every_row_runs_on_cpu(monkeypatch, capsys):
    import torch
    from submission.evaluate.systems import grid
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    systems = grid([("m", "/m"), ("n", "/n")], ["decoder", "ct2"], ["fp16", "int8"], [1, 4], [2], ["throughput"],
                   device="cuda")
    assert systems and {s.device for s in systems} == {"cpu"}
    assert capsys.readouterr().err == "warning: CUDA is not available; running on CPU\n"


def test_ct2_throughput_runs_one_worker_per_thread_as_its_guide_recommends():
    from submission.evaluate.systems import grid
    by_mode = {s.mode: s for s in grid([("m", "/m")], ["ct2"], ["int8"], [1], [4], ["throughput", "latency"])}
    assert by_mode["throughput"].extra == {"ct2_inter_threads": 4, "ct2_intra_threads": 1}
    assert by_mode["latency"].extra == {"ct2_inter_threads": 1, "ct2_intra_threads": 4}
    assert "4x1t" in by_mode["throughput"].label and "4t" in by_mode["latency"].label


def test_our_throughput_runs_one_worker_process_per_thread_as_the_containers_cpu_all_mode(tiny, tmp_path):
    from submission.evaluate import worker
    from submission.evaluate.systems import grid
    by_mode = {s.mode: s for s in grid([("m", tiny["model"])], ["decoder"], ["int8"], [1], [2],
                                       ["throughput", "latency"])}
    assert by_mode["throughput"].extra == {"workers": 2} and "2x1t" in by_mode["throughput"].label
    assert by_mode["latency"].extra == {} and "2t" in by_mode["latency"].label
    assert grid([("m", tiny["model"])], ["decoder"], ["int8"], [1], [1], ["throughput"])[0].extra == {}
    spec = {"engine": "decoder", "model_dir": tiny["model"], "mode": "throughput", "precision": "int8", "beam": 1,
            "threads": 2, "max_tokens": 100, "device": "cpu", "extra": by_mode["throughput"].extra}
    go, facts = worker.load(spec, str(tmp_path))
    assert len(facts["pids"]) == 2 and go(["a b c", "", "d e"])[1] == ""
    assert worker.peak_rss_mb(facts["pids"]) > worker.peak_rss_mb() + 20  # the workers' model copies count


def test_a_shortlisted_model_gets_our_shortlist_row_beside_ct2s_vmap_row(tiny, tmp_path, monkeypatch):
    import shutil

    import torch

    from decoder import modeldir
    from submission.evaluate import worker
    from submission.evaluate.systems import grid
    d = str(tmp_path / "m")
    shutil.copytree(tiny["model"], d)
    V = modeldir.read_config(d).arch.vocab_size
    modeldir.write_shortlist(d, torch.arange(0, 2 * V + 1, 2), torch.arange(2 * V) % V, torch.arange(4, 8))
    systems = grid([("m", d)], ["decoder", "ct2"], ["int8"], [1], [2], ["throughput"])
    assert sorted(tuple(sorted(s.extra)) for s in systems if s.engine == "decoder") == [("shortlist", "workers"),
                                                                                     ("workers",)]
    vmap = [s for s in systems if s.engine == "ct2" and s.extra.get("ct2_vmap")]
    assert len(vmap) == 1 and vmap[0].extra["ct2_inter_threads"] == 2 and "vmap" in vmap[0].label
    assert len(grid([("m", tiny["model"])], ["decoder", "ct2"], ["int8"], [1], [2], ["throughput"])) == 2
    seen = {}
    monkeypatch.setattr("tools.baselines.ct2_translator", lambda d, m, run, device, **kw: seen.setdefault("run", run))
    monkeypatch.setattr("tools.convert.to_ctranslate2", lambda m, out, quantization: out)
    spec = {"engine": "ct2", "model_dir": d, "mode": "throughput", "precision": "int8", "beam": 1, "threads": 2,
            "max_tokens": 100, "device": "cpu", "extra": vmap[0].extra}
    worker.load(spec, str(tmp_path))
    assert seen["run"].use_vmap and seen["run"].inter_threads == 2
    assert not seen["run"].one_cap  # on a CPU each sentence its own cap, as ours


def test_ct2_on_a_gpu_runs_in_one_call_at_our_gpu_batch_budget_with_our_text_processes(tmp_path, monkeypatch):
    """In one call per length cap CTranslate2's GPU batches were a few dozen sentences (tools/bench_gpu.py)."""
    from decoder.cliargs import GPU_MAX_TOKENS
    from submission.evaluate import worker
    seen = []
    monkeypatch.setattr("tools.baselines.ct2_translator", lambda d, m, run, device, text_processes: seen.append(
        (run, device, text_processes)))
    monkeypatch.setattr("tools.convert.to_ctranslate2", lambda m, out, quantization: out)
    monkeypatch.setattr("decoder.pipeline.os.sched_getaffinity", lambda pid: set(range(16)))
    for beam, tokens in ((1, None), (4, None), (4, 5000)):
        spec = {"engine": "ct2", "model_dir": "m", "mode": "throughput", "precision": "fp16", "beam": beam,
                "threads": 1, "max_tokens": tokens, "device": "cuda", "extra": {}}
        worker.load(spec, str(tmp_path))
    assert [(r.compute_type, r.one_cap, r.max_batch_size, dev, n) for r, dev, n in seen] == [
        ("float16", True, GPU_MAX_TOKENS, "cuda", 8), ("float16", True, GPU_MAX_TOKENS // 4, "cuda", 8),
        ("float16", True, 5000, "cuda", 8)]


def test_test_set_pair_from_file_suffixes_or_given(tiny, tmp_path, capsys):
    from submission.evaluate.__main__ import load_testset, parse_args
    from submission.evaluate.testsets import from_files
    ts = from_files(tiny["src"], [tiny["ref"]])
    assert (ts.src_lang, ts.tgt_lang) == ("en", "es")
    txt = write(tmp_path / "src.txt", tiny["src_lines"])
    assert from_files(txt, [tiny["ref"]]).src_lang is None
    ts = load_testset(parse_args(["--src", txt, "--ref", tiny["ref"], "-l", "fr-de"]), [])
    assert (ts.src_lang, ts.tgt_lang) == ("fr", "de")


@pytest.fixture(scope="module")
def cli_run(tiny):
    """One whole evaluation through the CLI: ours, CTranslate2 and HF on the same weights."""
    out = tiny["dir"] / "out"
    r = subprocess.run([sys.executable, "-m", "submission.evaluate", "--model", f"tiny={tiny['model']}",
                        "--src", tiny["src"], "--ref", tiny["ref"], "--engines", "decoder,ct2,hf",
                        "--precision", "fp32", "--threads", "1", "--repeats", "2", "--warmup-lines", "4",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    read = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]  # noqa: E731
    return {"out": out, "stdout": r.stdout, "summary": read("summary.jsonl"),
            "measurements": read("measurements.jsonl")}


def test_tiny_model_evaluation_measures_every_engine(cli_run, tiny):
    from submission.evaluate import slug
    from submission.evaluate.scoring import score
    rows = cli_run["summary"]
    assert sorted(r["engine"] for r in rows) == ["ct2", "decoder", "hf"]
    for r in rows:
        assert "error" not in r, r
        hyps = (cli_run["out"] / "hyps" / (slug(r["system"]) + ".txt")).read_text(encoding="utf-8").split("\n")[:-1]
        assert len(hyps) == len(tiny["src_lines"])
        # the recorded score is the score of the written output
        assert {k: r[k] for k in ("bleu", "chrf")} == \
            {k: v for k, v in score(hyps, [tiny["ref_lines"]]).items() if k in ("bleu", "chrf")}
        assert r["src_words_per_s"] > 0 and r["tgt_tokens_per_s"] > 0
        assert r["src_words_per_s_min"] <= r["src_words_per_s"] <= r["src_words_per_s_max"]
        assert r["repeats"] == 2 and r["identical_repeats"]
        assert r["load_s"] > 0 and r["warmup_s"] > 0 and r["warmup_lines"] == 4
        assert r["peak_ram_mb"] >= r["peak_ram_after_load_mb"] > 50  # a Python process with torch
        assert r["model_mb"] > 0
        assert r["system"] in cli_run["stdout"]  # the markdown table
    phases = {}
    for m in cli_run["measurements"]:
        phases.setdefault(m["system"], []).append(m["phase"])
    for label, ph in phases.items():
        assert ph.count("load") >= 1 and ph.count("warmup") == 1 and ph.count("run") == 2, (label, ph)
    assert "convert" in phases[next(r["system"] for r in rows if r["engine"] == "ct2")]
    for name in ("pareto.png", "summary.csv", "measurements.csv", "results.md"):
        assert (cli_run["out"] / name).stat().st_size > 0
    csv_lines = (cli_run["out"] / "measurements.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(cli_run["measurements"])


def test_json_records_carry_signature_hardware_and_config(cli_run, tiny):
    for r in cli_run["summary"]:
        assert r["bleu_signature"].startswith("nrefs:1|") and "tok:13a" in r["bleu_signature"]
        assert r["chrf_signature"].startswith("nrefs:1|")
    for r in cli_run["summary"] + cli_run["measurements"]:
        hw = r["hardware"]
        assert hw["cpu"] and hw["cores"] >= 1 and isinstance(hw["flags"], list) and hw["versions"]["torch"]
        c = r["config"]
        assert c["model_dir"] == tiny["model"] and c["threads"] == 1 and c["beam"] == 1
        assert c["precision"] == "fp32" and c["engine"] == r["engine"] and c["mode"] == "throughput"
        assert r["testset"]["lines"] == len(tiny["src_lines"])


def test_latency_mode_reports_per_sentence_percentiles(tiny, tmp_path):
    from submission.evaluate import System, evaluate
    from submission.evaluate.testsets import from_files
    sysm = System("decoder", "tiny", "latency", tiny["model"], "fp32", beam=2, threads=1)
    [r] = evaluate([sysm], from_files(tiny["src"], [tiny["ref"]]), str(tmp_path), repeats=2, warmup_lines=2,
                   latency_lines=5, log=lambda m: None)
    assert "error" not in r, r
    assert r["lines"] == 5
    assert 0 < r["latency_ms_p50"] <= r["latency_ms_p90"] <= r["latency_ms_p99"]
    assert (tmp_path / "pareto-latency.png").stat().st_size > 0
    runs = [m for m in map(json.loads, (tmp_path / "measurements.jsonl").read_text().splitlines())
            if m["phase"] == "run"]
    assert len(runs) == 2 and all("latency_ms_p99" in m for m in runs)


def cli_error(capsys, argv) -> str:
    from submission.evaluate.__main__ import main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_input_is_one_error_line(tiny, tmp_path, capsys):
    short = write(tmp_path / "short.es", tiny["ref_lines"][:3])
    base = ["--model", tiny["model"], "--out", str(tmp_path / "out")]
    assert "has 3 lines" in cli_error(capsys, base + ["--src", tiny["src"], "--ref", short])
    assert "--src and --ref" in cli_error(capsys, base + ["--src", tiny["src"]])
    assert "does not exist" in cli_error(capsys, ["--model", str(tmp_path / "nope"), "--src", tiny["src"],
                                                  "--ref", tiny["ref"]])
    assert "unknown engine" in cli_error(capsys, base + ["--src", tiny["src"], "--ref", tiny["ref"],
                                                         "--engines", "moses"])
    assert "unknown sacreBLEU test set" in cli_error(capsys, base + ["-t", "wmt99", "-l", "en-de"])
    assert "no language pair" in cli_error(capsys, base + ["-t", "wmt22", "-l", "en-xx"])
    assert "goes with" in cli_error(capsys, base + ["-l", "en-de"])


def test_sacrebleu_test_set_offline_is_one_error_line(tiny, tmp_path, capsys, monkeypatch):
    from sacrebleu.dataset import DATASETS

    def offline(self, langpair):
        sys.exit(1)  # what sacreBLEU does when its download fails
    monkeypatch.setattr(type(DATASETS["wmt22"]), "get_files", offline)
    err = cli_error(capsys, ["--model", tiny["model"], "-t", "wmt22", "-l", "en-de", "--out", str(tmp_path)])
    assert "wmt22 en-de" in err and "offline" in err


@pytest.mark.slow
def test_container_is_measured_through_run_sh(tmp_path):
    from test_container import docker_or_skip
    docker_or_skip()
    from submission.evaluate import evaluate
    from submission.evaluate.systems import container_systems
    from submission.evaluate.testsets import TestSet
    from submission.image import build
    from test_container import BIBLE_TINY
    model = BIBLE_TINY if os.path.isfile(os.path.join(BIBLE_TINY, "model.safetensors")) else None
    if model is None:  # the same cached random model as test_container: same image key, no rebuild
        import hashlib
        src = open(os.path.join(ROOT, "tests", "fixture_model.py"), "rb").read()
        model = os.path.join(ROOT, "build", f"container-test-model-{hashlib.sha256(src).hexdigest()[:12]}")
        if not os.path.isfile(os.path.join(model, "spm.model")):
            make_model_dir(model, vocab_size=300, d_model=64)
    image = build(model, quiet=True)
    src = synthetic_corpus(12, seed=21)
    ts = TestSet("synthetic", src, [synthetic_corpus(12, seed=22)], "en", "es", "synthetic")
    rows = evaluate(container_systems(image, image, ["CPU-1"], ["throughput", "latency"], 2.0), ts,
                    str(tmp_path), repeats=1, warmup_lines=2, log=lambda m: None)
    from test_container import ONE_LATENCY, reference
    text = "".join(x + "\n" for x in src).encode()
    # /run.sh CPU-1 is `python -m decoder --threads 1` at the default precision (+ the shortlist, + batch 1
    # for latency): the container's output must be the host's at fp32 or int8 (test_container pins the one
    # it printed)
    want = {mode: [reference(model, text, args, p).decode().split("\n")[:-1] for p in ("fp32", "int8")]
            for mode, args in (("throughput", ["--threads", "1"]), ("latency", ONE_LATENCY))}
    from submission.evaluate import slug
    for r in rows:
        assert "error" not in r, r
        assert r["image_mb"] > 10 and r["model_mb"] > 0 and r["load_s"] > 0
        assert r["peak_ram_mb"] and r["peak_ram_mb"] > 20
        hyps = (tmp_path / "hyps" / (slug(r["system"]) + ".txt")).read_text(encoding="utf-8").split("\n")[:-1]
        assert hyps in want[r["mode"]], r["system"]
    assert rows[1]["latency_ms_p50"] > 0


def test_replot_redraws_the_chart_from_summary_csv_and_jsonl(tmp_path, capsys):
    from submission.evaluate.__main__ import main
    from submission.evaluate.report import read_summaries, write_csv, write_jsonl
    rows = [{**r, "hardware": HW, "testset": {**TESTSET, "src_lang": None, "tgt_lang": None,
                                              "origin": "news.en news.de"}} for r in CHART_ROWS]
    write_csv(str(tmp_path / "summary.csv"), rows)
    write_jsonl(str(tmp_path / "summary.jsonl"), rows)
    back = read_summaries(str(tmp_path / "summary.csv"))
    assert [(r["system"], r.get("bleu"), r["hardware"]["flags"], r.get("config")) for r in back] == \
        [(r["system"], r["bleu"], r["hardware"]["flags"], r.get("config")) for r in rows]
    for name in ("summary.csv", "summary.jsonl"):
        out = tmp_path / name.replace(".", "-")
        assert main(["--replot", str(tmp_path / name), "--out", str(out)]) == 0
        assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert "none.csv: no such file" in cli_error(capsys, ["--replot", str(tmp_path / "none.csv")])


@pytest.mark.parametrize("content, says", [
    (b"\xff\xfe\n", "not UTF-8 text"),
    (b'{"mode": "throughput"}\n\n{"a":\n', "line 3: invalid JSON"),
    (b"[1, 2]\n", "record 1 is not a JSON object"),
    (b'{"mode": "throughput"}\n', "record 1 has no system, engine: not a summary record"),
])
def test_replot_of_a_file_that_is_not_a_summary_is_one_error_line(tmp_path, capsys, content, says):
    (tmp_path / "s.jsonl").write_bytes(content)
    assert says in cli_error(capsys, ["--replot", str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "o")])


def test_replot_of_a_summary_with_a_field_of_the_wrong_type_is_one_error_line(tmp_path, capsys):
    from submission.evaluate.report import write_jsonl
    rows = [{**r, "hardware": HW, "testset": TESTSET} for r in CHART_ROWS]
    rows[0]["src_words_per_s"] = "fast"
    write_jsonl(str(tmp_path / "s.jsonl"), rows)
    assert "not a summary as evaluate writes it (TypeError" in \
        cli_error(capsys, ["--replot", str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "o")])
