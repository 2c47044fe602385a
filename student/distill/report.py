"""The run's one table: BLEU/chrF on the test split, words/s with the lean decoder, model size."""
from __future__ import annotations

import json
import os
import time

import torch

from decoder.machine import cpu_info, isa
from student.distill.stages import write_json
from student.distill.teachers import ModelTeacher, lean_translator
from student.train.evaluate import score


def machine() -> str:
    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name(0)}"
    cpu = cpu_info()
    return f"CPU {cpu['cpu']} ({isa(cpu['flags'])}), {torch.get_num_threads()} threads"


def evaluate(out_dir: str, prep, systems, cfg, manifest: dict, log=print) -> dict:
    """Translate the test split with each system; writes report.md/report.json into out_dir."""
    src, ref = prep.read("test")
    if cfg.test_limit:
        src, ref = src[:cfg.test_limit], ref[:cfg.test_limit]
    n_words = sum(len(x.split()) for x in src)
    rows = []
    for name, system, _ in systems:
        if isinstance(system, str):  # a student model dir: decoded the way a submission would
            system = ModelTeacher([system], beam=cfg.student_beam, engine=cfg.engine,
                                  precision=cfg.precision)
        rows.append(measure(name, system, src, ref, out_dir, log))
    stages = {k: {"status": v.get("status"), "seconds": v.get("seconds")} for k, v in manifest["stages"].items()}
    training = training_facts(systems)
    rep = {"run": cfg.name, "test": {"sentences": len(src), "words": n_words, "pair": f"{prep.src_lang}-{prep.tgt_lang}",
                                     "prepared": prep.dir, "set": prep.held_out.get("test")},
           "machine": machine(), "lean_decoder": lean_translator() is not None,
           "systems": rows, "stages": stages, "training": training, "verdict": verdict(rows, training)}
    write_json(os.path.join(out_dir, "report.json"), rep)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as fh:
        fh.write(markdown(rep))
    return {"systems": [{k: r[k] for k in ("system", "bleu", "chrf", "words_per_second")} for r in rows]}


def measure(name: str, system, src: list[str], ref: list[str], out_dir: str, log=print) -> dict:
    """One system's row: scores, words/s (loading excluded), engine and size; writes test.<name>.hyp."""
    system.load()  # loading is not translation speed
    log(f"[report] translating {len(src)} test sentences with the {name}: {system.name}")
    t0 = time.perf_counter()
    hyps = system.translate(src, where=f"the test split ({name})")
    secs = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"test.{name}.hyp"), "w", encoding="utf-8") as fh:
        fh.writelines(h + "\n" for h in hyps)
    m = score(hyps, ref)
    n_words = sum(len(x.split()) for x in src)
    return {"system": name, "description": system.name, "engine": system.engine_label(),
            "beam": getattr(system, "beam", None), "bleu": m["bleu"], "chrf": m["chrf"],
            "words_per_second": round(n_words / secs, 1), "seconds": round(secs, 2),
            **{f"size_{k}": v for k, v in system.size().items()},
            "bleu_signature": m["bleu_signature"], "chrf_signature": m["chrf_signature"]}


def training_facts(systems) -> dict:
    """The students' training facts (their stage's train/metrics.json), for the verdict."""
    out = {}
    for name, system, _ in systems:
        if not isinstance(system, str):  # a teacher object, not a student's model dir
            continue
        metrics = os.path.join(os.path.dirname(system), "train", "metrics.json")
        if os.path.exists(metrics):
            with open(metrics, encoding="utf-8") as fh:
                m = json.load(fh)
            out[name] = {"steps": m["step"], "minutes": m["train_minutes"], "stop_reason": m["stop_reason"],
                         "dev_bleu": [h["dev_bleu"] for h in m["history"]],
                         "dev_steps": [h["step"] for h in m["history"]]}
    return out


# Below this test BLEU a system has not learned to translate: unrelated output scores
# 0-0.5 against any reference, so a gap between two such systems means nothing.
LEARNED_BLEU = 1.0


def verdict(rows: list[dict], training: dict) -> list[str]:
    """The acceptance questions in words: is the KD student within 0.5 BLEU of
    its teacher, does it beat the same student without KD, and, where not,
    whether its dev BLEU was still rising (the budget, not the recipe, limits it).
    A system that did not learn is said to have failed, and no comparison with it is made."""
    bleu = {r["system"]: r["bleu"] for r in rows}
    failed = [n for n, b in bleu.items() if b < LEARNED_BLEU]
    out = [f"{n} failed to learn: test BLEU {bleu[n]:.2f} (below {LEARNED_BLEU}); it needs more training "
           "steps (or a look at its data) before any comparison means something." for n in failed]

    def compare(a: str, b: str, label: str, words) -> None:
        if a in bleu and b in bleu:
            d = bleu[a] - bleu[b]
            out.append(f"{label}: {d:+.2f} BLEU ("
                       + ("no verdict: " + " and ".join(n for n in (a, b) if n in failed) + " failed to learn"
                          if a in failed or b in failed else words(d)) + ").")
    compare("student", "teacher", "KD student vs teacher",
            lambda d: f"{'within' if d >= -0.5 else 'misses'} the 0.5 aim")
    compare("student", "baseline", "KD student vs the same student without KD",
            lambda d: f"{'distillation helps' if d > 0 else 'distillation does not help'} at this budget")
    for name, t in training.items():
        curve = t["dev_bleu"]
        line = f"{name}: {t['steps']} steps, {t['minutes']:.0f} training minutes ({t['stop_reason']})"
        if curve:
            line += ", dev BLEU " + " -> ".join(f"{b:.1f}" for b in curve)
            if len(curve) > 1 and curve[-1] > curve[-2]:
                line += ", still rising at the end: more steps would raise it"
        out.append(line + ".")
    return out


def markdown(rep: dict) -> str:
    t = rep["test"]
    lines = [f"# Distillation report: {rep['run']}", "",
             f"Test set: {t['sentences']} sentences, {t['words']} source words ({t['pair']})"
             + (f", from {t['set']}" if t.get("set") else "") + f". Machine: {rep['machine']}.", "",
             "| system | BLEU | chrF | words/s | search | engine | parameters | size (MB) |",
             "|---|---:|---:|---:|---|---|---:|---:|"]
    for r in rep["systems"]:
        beam = "" if r["beam"] is None else ("greedy" if r["beam"] == 1 else f"beam {r['beam']}")
        params = f"{r['size_params'] / 1e6:.3g} M" if r.get("size_params") else "-"
        size = f"{r['size_bytes'] / 2**20:.3g}" if r.get("size_bytes") else "-"
        lines.append(f"| {r['system']} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['words_per_second']:.0f} | "
                     f"{beam or '-'} | {r['engine']} | {params} | {size} |")
    if rep.get("verdict"):
        lines += [""] + [f"- {v}" for v in rep["verdict"]]
    lines += ["", "Systems:"]
    lines += [f"- {r['system']}: {r['description']}" for r in rep["systems"]]
    if not rep["lean_decoder"]:
        lines += ["", "Note: decoder.Translator is not available yet; our models were decoded with the "
                      "reference search in student/distill/beam.py (words/s are not the lean decoder's)."]
    if rep["systems"]:
        lines += ["", f"BLEU: `{rep['systems'][0]['bleu_signature']}`",
                  f"chrF: `{rep['systems'][0]['chrf_signature']}`"]
    lines += ["", "| stage | status | seconds |", "|---|---|---:|"]
    lines += [f"| {k} | {v['status']} | {v['seconds']} |" for k, v in rep["stages"].items()]
    return "\n".join(lines) + "\n"


def load(run_dir: str) -> tuple[dict, str]:
    with open(os.path.join(run_dir, "report.json"), encoding="utf-8") as fh:
        rep = json.load(fh)
    with open(os.path.join(run_dir, "report.md"), encoding="utf-8") as fh:
        return rep, fh.read()
