"""Every system on one BLEU-vs-words/s chart: our decoder configurations, CTranslate2 and
HF on the same weights, the teacher, and the submission container.

    python -m submission.evaluate --model student=DIR --teacher DIR --container wmt-kit:latest

Library: `evaluate(systems, testset, out_dir)` measures each system (local ones in a child
process each, so peak RSS is per system), scores it with sacreBLEU and writes
measurements.{jsonl,csv}, summary.{jsonl,csv}, results.md and pareto.png into out_dir.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile

from . import container, local, report
from .hardware import describe
from .scoring import percentiles, score, source_words, spread, target_pieces
from .systems import EvalError, System
from .testsets import TestSet

__all__ = ["evaluate", "EvalError", "System", "TestSet"]


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", s).strip("_")


def summarise(system: System, res: dict, lines: list[str], refs: list[list[str]], ts: TestSet,
              spm_path: str | None) -> tuple[dict, list[dict]]:
    """(summary record, measurement records) for one system's raw result."""
    words = source_words(lines)
    base = {"system": system.label, "engine": system.engine, "name": system.name, "mode": system.mode,
            "config": system.config()}
    if "error" in res:
        return {**base, "error": res["error"]}, []
    hyps = res["hyps"]
    pieces = target_pieces(spm_path, hyps) if spm_path else None
    meas = [{**base, "phase": "load", "repeat": i, "seconds": t}
            for i, t in enumerate(res.get("load_runs_s") or [res["load_s"]])]
    if res.get("convert_s") is not None:
        meas.append({**base, "phase": "convert", "seconds": res["convert_s"]})
    w = res["warmup"]
    meas.append({**base, "phase": "warmup", "seconds": w["seconds"], "lines": w["lines"],
                 "src_words_per_s": source_words(lines[:w["lines"]]) / w["seconds"] if w["seconds"] else None})
    all_lat = []
    for i, run in enumerate(res["runs"]):
        m = {**base, "phase": "run", "repeat": i, "lines": len(lines), "seconds": run["seconds"],
             "src_words_per_s": words / run["seconds"],
             "tgt_tokens_per_s": pieces / run["seconds"] if pieces is not None else None}
        if "wall_s" in run:
            m["wall_s"] = run["wall_s"]
        if "latencies_s" in run:
            all_lat += run["latencies_s"]
            m.update({f"latency_ms_{k}": v * 1e3 for k, v in percentiles(run["latencies_s"]).items()})
        meas.append(m)
    wps = spread([m["src_words_per_s"] for m in meas if m["phase"] == "run"])
    secs = spread([r["seconds"] for r in res["runs"]])
    s = {**base, **score(hyps, refs, ts.tgt_lang), "lines": len(lines), "src_words": words,
         "src_words_per_s": wps["median"], "src_words_per_s_min": wps["min"], "src_words_per_s_max": wps["max"],
         "src_words_per_s_rel_spread": wps["rel_spread"], "repeats": wps["n"],
         "seconds_median": secs["median"],
         "tgt_tokens_per_s": pieces / secs["median"] if pieces is not None else None,
         "load_s": res["load_s"], "convert_s": res.get("convert_s"), "warmup_s": w["seconds"],
         "warmup_lines": w["lines"], "identical_repeats": res["identical_repeats"]}
    s.update({f"latency_ms_{k}": v * 1e3 for k, v in percentiles(all_lat).items()})
    if system.engine == "container":
        s.update(peak_ram_mb=res.get("peak_mem_mb"), peak_ram_source="container cgroup peak",
                 model_mb=res["model_bytes"] / 2**20, image_mb=res["image_bytes"] / 2**20)
    else:
        s.update(peak_ram_mb=res["peak_rss_mb"], peak_ram_source="process peak RSS",
                 peak_ram_after_load_mb=res["rss_after_load_mb"], model_mb=res["model_bytes"] / 2**20)
    return s, meas


def evaluate(systems: list[System], ts: TestSet, out_dir: str, *, repeats: int = 3, warmup_lines: int = 100,
             latency_lines: int = 200, max_tokens: int | None = None, mem_limit: str = "2g",
             timeout: float | None = None, log=None) -> list[dict]:
    """Measure every system on ts; write the outputs; return the summary records."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if repeats < 1:
        raise EvalError("repeats must be at least 1")
    os.makedirs(os.path.join(out_dir, "hyps"), exist_ok=True)
    hw = describe(container.client() if any(s.engine == "container" for s in systems) else None)
    tsrec = {"name": ts.name, "origin": ts.origin, "lines": len(ts.src), "src_words": source_words(ts.src),
             "src_lang": ts.src_lang, "tgt_lang": ts.tgt_lang}
    summaries, measurements = [], []
    with tempfile.TemporaryDirectory(prefix="evaluate-images-") as tmp:
        facts = {}  # image -> its size and its /model, read once
        for i, sysm in enumerate(systems):
            n = latency_lines if sysm.mode == "latency" and latency_lines else len(ts.src)
            lines, refs = ts.src[:n], [r[:n] for r in ts.refs]
            log(f"[evaluate] {i + 1}/{len(systems)} {sysm.label}: {len(lines)} lines x {repeats}")
            try:
                if sysm.engine == "container":
                    if sysm.image not in facts:
                        facts[sysm.image] = container.image_facts(sysm.image, os.path.join(tmp, str(len(facts))))
                    res = {**container.measure(sysm, lines, repeats, warmup_lines, mem_limit),
                           **facts[sysm.image]}
                    spm_path = os.path.join(facts[sysm.image]["model_dir"], "spm.model")
                    res.pop("model_dir")
                else:
                    res = local.run_local(sysm, lines, repeats, warmup_lines, max_tokens, hw["ct2_isa"], timeout)
                    spm_path = os.path.join(sysm.model_dir, "spm.model")
            except EvalError as e:
                res = {"error": str(e)}
            s, meas = summarise(sysm, res, lines, refs, ts, spm_path if "error" not in res else None)
            for r in [s, *meas]:
                r["testset"], r["hardware"] = tsrec, hw
            if "error" in s:
                log(f"[evaluate]   failed: {s['error']}")
            else:
                with open(os.path.join(out_dir, "hyps", slug(sysm.label) + ".txt"), "w", encoding="utf-8") as fh:
                    fh.writelines(h + "\n" for h in res["hyps"])
                log(f"[evaluate]   BLEU {s['bleu']:.2f} chrF {s['chrf']:.2f}, {s['src_words_per_s']:.1f} words/s "
                    f"(±{100 * s['src_words_per_s_rel_spread']:.0f}%), load {s['load_s']:.2f} s, "
                    f"peak RAM {s['peak_ram_mb'] or 0:.0f} MB")
            summaries.append(s)
            measurements += meas
    write_outputs(summaries, measurements, hw, tsrec, out_dir)
    return summaries


def replot(summary_path: str, out_dir: str) -> list[str]:
    """Draw the charts again from a summary.jsonl/.csv (new chart code, same measurements)."""
    if not os.path.isfile(summary_path):
        raise EvalError(f"{summary_path}: no such file")
    rows = _summary_records(summary_path)
    ok = [r for r in rows if r.get("hardware") and r.get("testset")]
    if not ok:
        raise EvalError(f"{summary_path}: no summary records with hardware and test set")
    ts = ok[0]["testset"]
    if not ts.get("src_lang"):  # written before the pair was read from the file names
        from .testsets import lang_suffix
        paths = ts.get("origin", "").split()
        if len(paths) >= 2:
            ts = {**ts, "src_lang": lang_suffix(paths[0]), "tgt_lang": lang_suffix(paths[1])}
    os.makedirs(out_dir, exist_ok=True)
    try:
        return write_charts(rows, ok[0]["hardware"], ts, out_dir)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field missing or of the wrong type
        raise EvalError(f"{summary_path}: not a summary as evaluate writes it ({type(e).__name__}: {e})") from None


def _summary_records(path: str) -> list[dict]:
    """The file's records, each a JSON object with the fields every chart point needs, or
    one EvalError naming what is wrong (a hand-edited or foreign file)."""
    try:
        rows = report.read_summaries(path)
    except UnicodeDecodeError:
        raise EvalError(f"{path}: not UTF-8 text") from None
    except ValueError as e:  # a line that is not JSON
        raise EvalError(f"{path}: {e}") from None
    for i, r in enumerate(rows, 1):
        if not isinstance(r, dict):
            raise EvalError(f"{path}: record {i} is not a JSON object")
        if missing := [k for k in ("mode", "system", "engine") if k not in r]:
            raise EvalError(f"{path}: record {i} has no {', '.join(missing)}: not a summary record")
    return rows


def write_charts(summaries, hw, tsrec, out_dir) -> list[str]:
    paths = []
    for mode in sorted({s["mode"] for s in summaries}):
        sel = [s for s in summaries if s["mode"] == mode]
        data = report.chart_data(sel, hw, tsrec, mode)
        paths.append(os.path.join(out_dir, "pareto.png" if mode == "throughput" else f"pareto-{mode}.png"))
        report.plot_pareto(data, paths[-1])
        for s in sel:
            s["on_frontier"] = any(p["on_frontier"] and p["record"] is s for p in data["points"])
    return paths


def write_outputs(summaries, measurements, hw, tsrec, out_dir) -> None:
    write_charts(summaries, hw, tsrec, out_dir)
    report.write_jsonl(os.path.join(out_dir, "measurements.jsonl"), measurements)
    report.write_csv(os.path.join(out_dir, "measurements.csv"), measurements)
    report.write_jsonl(os.path.join(out_dir, "summary.jsonl"), summaries)
    report.write_csv(os.path.join(out_dir, "summary.csv"), summaries)
    with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as fh:
        fh.write(report.markdown(summaries, hw, tsrec))
