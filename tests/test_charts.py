"""The pictures are drawn by the tools that measure, from the data they record:
the bench's chart (tools/bench_chart.py), the dev-BLEU curves (student/chart.py)."""
import json
import os
import re
import subprocess
import sys

from student import chart
from tools import bench_chart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"
BENCH = os.path.join(ROOT, "docs", "bench")


def row(engine, group, wps, h2h=False):
    return {"config": f"{engine} {group}", "engine": engine, "group": group, "src_words_per_s": wps,
            "precision": "int8", "h2h": h2h}


def fake_bench(isa="avx512") -> dict:
    rows = [row("ours", "throughput", 900.0), row("ours", "throughput", 1000.0), row("ct2", "throughput", 800.0),
            row("hf", "throughput", 100.0), row("ours", "batch1", 300.0), row("ct2", "batch1", 310.0),
            row("ours", "throughput", 990.0, h2h=True), row("ct2", "throughput", 900.0, h2h=True)]
    machine = {"cpu": "Test CPU", "cores": 2, "threads": 2, "torch": "2.x", "ctranslate2": "4.x",
               "date": "2026-01-01T00:00:00Z", "isa": isa}
    return {"machine": machine, "model": "runs/x/student-model", "rows": rows,
            "model_facts": {"shape": "d 32, 2 heads, ffn 64, 1+1 layers, vocab 320, 0.1M parameters"}}


def test_bench_bars_are_the_rows_the_ratios_name():
    bars = {b["group"]: b for b in bench_chart.bars(fake_bench())}
    assert set(bars) == {"throughput", "batch1"}  # beam 4 did not run: no bars
    # throughput: the head-to-head pair, not the best rows as timed apart
    assert bars["throughput"] == {"group": "throughput", "ours": 990.0, "ct2": 900.0, "hf": 100.0,
                                  "ratio": 1.1, "h2h": True}
    assert bars["batch1"]["ratio"] == round(300 / 310, 3) and not bars["batch1"]["h2h"]


def test_bench_chart_command_draws_a_png_from_bench_json(tmp_path):
    for isa in ("avx512", "avx2"):
        (tmp_path / f"{isa}.json").write_text(json.dumps(fake_bench(isa)))
    out = tmp_path / "chart.png"
    r = subprocess.run([sys.executable, "-m", "tools.bench_chart", str(tmp_path / "avx512.json"),
                        str(tmp_path / "avx2.json"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 10_000


def test_bench_chart_of_a_file_that_is_not_bench_json_is_one_error_line(tmp_path):
    (tmp_path / "x.json").write_text('{"rows": []}')
    r = subprocess.run([sys.executable, "-m", "tools.bench_chart", str(tmp_path / "x.json"), "--out",
                        str(tmp_path / "c.png")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert not (tmp_path / "c.png").exists()


def test_committed_bench_chart_data_is_the_committed_summary():
    """docs/bench/README.md's chart is drawn from these JSON files: their bars give summary.json's ratios."""
    summary = json.load(open(os.path.join(BENCH, "summary.json")))
    readme = open(os.path.join(BENCH, "README.md")).read()
    chart = re.search(r"!\[[^]]*\]\(([^)]+)\.png\)", readme).group(1)  # the first chart: today's
    for s in summary:
        result = json.load(open(os.path.join(BENCH, f"{chart}-{s['isa']}.json")))
        got = {b["group"]: b["ratio"] for b in bench_chart.bars(result)}
        assert got == {"throughput": s["throughput_vs_ct2_best"], "batch1": s["batch1_vs_ct2"],
                       "beam4": s["beam4_vs_ct2"]}
        assert result["model"] == s["model"] and result["model_facts"]["shape"] == s["model_shape"]


def test_gpu_bench_json_charts_its_summarys_ratios(tmp_path):
    """docs/bench/gpu.md's chart: a tools.bench_gpu JSON gives the bars its own summary's ratios name,
    the ablation rows no engine's, and the command draws it."""
    gpu = os.path.join(BENCH, "gpu")
    summary = json.load(open(os.path.join(gpu, "summary-gpu.json")))[-1]
    page = open(os.path.join(BENCH, "gpu.md")).read()
    chart = re.search(r"!\[[^]]*\]\(([^)]+)\.png\)", page).group(1)
    result = json.load(open(os.path.join(BENCH, chart + ".json")))
    assert result["summary"] == summary
    got = {b["group"]: b["ratio"] for b in bench_chart.bars(bench_chart.from_gpu_bench(result))}
    assert got == {"throughput": summary["throughput_vs_ct2_best"], "batch1": summary["batch1_vs_ct2"],
                   "beam4": summary["beam4_vs_ct2"]}
    fake = {"machine": {"date": "2026-01-01"}, "summary": {"device": "cuda", "gpu": "Test GPU", "model": "m"},
            "rows": [row("ours fp16", "throughput", 500.0), row("ct2 float16", "throughput", 100.0),
                     row("ablation: ours fp16 without x", "throughput", 900.0)]}
    assert bench_chart.bars(bench_chart.from_gpu_bench(fake)) == [
        {"group": "throughput", "ours": 500.0, "ct2": 100.0, "ratio": 5.0, "h2h": False}]
    (tmp_path / "g.json").write_text(json.dumps(fake))
    r = subprocess.run([sys.executable, "-m", "tools.bench_chart", str(tmp_path / "g.json"), "--out",
                        str(tmp_path / "g.png")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g.png").read_bytes().startswith(PNG)


def test_dev_bleu_curves_are_a_png_from_recorded_metrics(tmp_path):
    metrics = json.load(open(os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "train-metrics.json")))
    steps, bleu = chart.curves_of(metrics)
    assert steps == [300, 600] and bleu == [0.82, 5.11]
    out = chart.plot_dev_bleu({"teacher": (steps, bleu), "student": ([100, 200, 300], [0.5, 2.0, 3.5])},
                              str(tmp_path / "runs" / chart.CHART), title="toy")
    assert out and open(out, "rb").read().startswith(PNG) and os.path.getsize(out) > 10_000


def test_no_dev_evaluation_draws_no_curve(tmp_path):
    assert chart.curves_of({"history": []}) == ([], [])
    assert chart.plot_dev_bleu({"student": ([], [])}, str(tmp_path / chart.CHART)) is None
    assert not (tmp_path / chart.CHART).exists()


def test_dev_bleu_command_redraws_a_distill_reports_curves(tmp_path):
    out = tmp_path / "c.png"
    r = subprocess.run([sys.executable, "-m", "student.chart", os.path.join(ROOT, "tests", "fixtures", "distill-default-report.json"),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr  # no runpy warning: the module is not pre-imported
    assert out.read_bytes().startswith(PNG)
    assert set(chart.curves_in(os.path.join(ROOT, "tests", "fixtures", "distill-default-report.json"))) == {"teacher", "student"}
    (tmp_path / "x.json").write_text("[1, 2]")
    r = subprocess.run([sys.executable, "-m", "student.chart", str(tmp_path / "x.json"), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
