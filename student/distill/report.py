"""The run's one table: BLEU/chrF on the test split, words/s with the lean decoder, model size."""
from __future__ import annotations

import json
import os
import time

import torch

from decoder.machine import cpu_info, device_kind, isa
from student import chart
from student.distill.stages import write_json
from student.distill.teachers import ModelTeacher, cpu_workers, lean_translator, workers_for
from student.train.evaluate import score


def machine() -> str:
    if device_kind() == "cuda":
        return f"GPU {torch.cuda.get_device_name(0)}"
    cpu = cpu_info()
    return f"CPU {cpu['cpu']} ({isa(cpu['flags'])}), {torch.get_num_threads()} threads"


def evaluate(out_dir: str, prep, systems, cfg, manifest: dict, log=print) -> dict:
    """Translate the test split with each system, greedy and with beam where it is a model of
    ours (searches()); writes report.md/report.json into out_dir."""
    src, ref = prep.read("test")
    if cfg.test_limit:
        src, ref = src[:cfg.test_limit], ref[:cfg.test_limit]
    n_words = sum(len(x.split()) for x in src)
    rows = []
    for name, system, _ in systems:
        for label, decoder, headline in searches(name, system, cfg, len(src)):
            rows.append({**measure(label, decoder, src, ref, out_dir, log), "system": name, "headline": headline})
            if hasattr(decoder, "close"):
                decoder.close()  # worker processes and model copies go before the next system loads
    add_speed_ratios(rows)
    stages = {k: {"status": v.get("status"), "seconds": v.get("seconds"), "note": stage_note(v.get("result"))}
              for k, v in manifest["stages"].items()}
    training = training_facts(systems)
    rep = {"run": cfg.name, "test": {"sentences": len(src), "words": n_words, "pair": f"{prep.src_lang}-{prep.tgt_lang}",
                                     "prepared": prep.dir, "set": prep.held_out.get("test")},
           "machine": machine(), "lean_decoder": lean_translator() is not None,
           "systems": rows, "summary": summary(rows), "stages": stages, "training": training,
           "verdict": verdict(rows, training)}
    write_json(os.path.join(out_dir, "report.json"), rep)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as fh:
        fh.write(markdown(rep))
    # the training curves behind the verdict's "still rising" lines, as a picture
    chart.plot_dev_bleu({n: (t["dev_steps"], t["dev_bleu"]) for n, t in training.items()},
                        os.path.join(out_dir, chart.CHART), title=f"{cfg.name}: dev BLEU of teacher and students")
    return {"systems": [{k: r[k] for k in ("system", "beam", "bleu", "chrf", "words_per_second")} for r in rows]}


def stage_note(result) -> str | None:
    """The distill stage's speed in words (the teacher at the decoder's fastest setting
    translates the whole training source: its words/s is the stage's cost)."""
    r = (result or {}).get("rank0") if isinstance(result, dict) else None
    if not r or not r.get("seconds"):
        return None
    how = ", ".join(str(x) for x in (result.get("engine"), result.get("precision")) if x)
    workers = f", {result['workers']} workers" if result.get("workers") else ""
    return (f"{r['sentences']} sentences, {r['words_per_second']:.0f} words/s, "
            f"{r['sentences'] / r['seconds']:.1f} sentences/s ({how}{workers}; rank 0 of {result.get('world', 1)})")


def searches(name: str, system, cfg, lines: int) -> list[tuple]:
    """(hyp file label, translator, headline?) per search a system is scored with.

    Our models get greedy and beam `--teacher-beam` alike, decoded the same way (lean
    decoder, the same precision rule, one worker process per core where the `lines` of the
    test split give each worker its share: workers_for), so each student row has a teacher
    row with the same search to compare with. The headline row is the teacher as it
    distilled, and each student at `--student-beam` (a submission's search). The baseline
    student, and teachers that are not our models, get their headline only."""
    beams = [cfg.teacher_beam] if name == "teacher" else [cfg.student_beam]
    if name in ("teacher", "student") and (isinstance(system, str) or isinstance(system, ModelTeacher)):
        beams += [b for b in (1, cfg.teacher_beam) if b not in beams]
    out = []
    for i, beam in enumerate(beams):
        label = name if i == 0 else f"{name}.{'greedy' if beam == 1 else f'beam{beam}'}"
        if isinstance(system, str):  # a student model dir: decoded the way a submission would
            out.append((label, ModelTeacher([system], beam=beam, engine=cfg.engine, precision=cfg.precision,
                                            workers=workers_for(lines, cpu_workers())), i == 0))
        elif i == 0 and workers_for(lines, own := getattr(system, "workers", 0)) == own:
            out.append((label, system, True))
        else:  # our teacher with its precision, the beam and workers this split takes
            out.append((label, ModelTeacher(system.dirs, beam=beam, engine=system.engine, device=str(system.device),
                                            precision=system.precision, workers=workers_for(lines, system.workers)),
                        i == 0))
    return out


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


def add_speed_ratios(rows: list[dict]) -> None:
    """Each non-teacher row's words/s over the teacher row's with the same search (beam)."""
    teacher = {r["beam"]: r["words_per_second"] for r in rows if r["system"] == "teacher"}
    for r in rows:
        if r["system"] != "teacher" and teacher.get(r["beam"]):
            r["over_teacher_words_s"] = round(r["words_per_second"] / teacher[r["beam"]], 2)


def _headline(rows: list[dict]) -> dict:
    """system -> its headline row (rows without the flag are headlines)."""
    return {r["system"]: r for r in rows if r.get("headline", True)}


def summary(rows: list[dict]) -> dict:
    """The run in three numbers: the teacher's BLEU as it distilled, the student's at its
    search, and the student's words/s over the teacher's (those two searches)."""
    h = _headline(rows)
    t, s = h.get("teacher"), h.get("student")
    return {"teacher_bleu": t and t["bleu"], "student_bleu": s and s["bleu"],
            "student_over_teacher_words_s": round(s["words_per_second"] / t["words_per_second"], 2)
            if t and s and t.get("words_per_second") else None}


def training_facts(systems) -> dict:
    """The training facts (train/metrics.json beside the model dir) of the students, and of
    a teacher that is one of our model dirs, for the verdict."""
    out = {}
    for name, system, _ in systems:
        model_dir = system if isinstance(system, str) else \
            (system.dirs[0] if isinstance(system, ModelTeacher) and len(system.dirs) == 1 else None)
        if model_dir is None:
            continue
        metrics = os.path.join(os.path.dirname(os.path.realpath(model_dir)), "train", "metrics.json")
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

# what stopped a training run (metrics.json's stop_reason), as its budget's name
BUDGETS = {"max_steps": "the step budget (--{role}-steps)", "max_minutes": "the time budget (--{role}-minutes)",
           "max_epochs": "the epoch limit", "patience": "patience (dev BLEU had stopped improving)"}


def verdict(rows: list[dict], training: dict) -> list[str]:
    """The acceptance questions in words: is the KD student within 1.0 BLEU of
    its teacher (the target; 0.5 the stretch), does it beat the same student without KD, how much faster it is,
    and which budget stopped each training run with its dev BLEU still rising or not.
    A system that did not learn is said to have failed, and no comparison with it is made."""
    head = _headline(rows)
    bleu = {n: r["bleu"] for n, r in head.items()}
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
            lambda d: "within the 1.0 target and the 0.5 stretch" if d >= -0.5 else
            "within the 1.0 target, not the 0.5 stretch" if d >= -1.0 else "misses the 1.0 target")
    compare("student", "baseline", "KD student vs the same student without KD",
            lambda d: f"{'distillation helps' if d > 0 else 'distillation does not help'} at this budget")
    s, t = head.get("student"), head.get("teacher")
    if s and t and s.get("words_per_second") and t.get("words_per_second"):
        same = [r for r in rows if r["system"] == "student" and r.get("over_teacher_words_s")]
        out.append(f"Speed: the student ({_search(s)}) translates {s['words_per_second'] / t['words_per_second']:.1f}x "
                   f"the teacher's ({_search(t)}) words/s" + ("; at the same search: " + ", ".join(
                       f"{_search(r)} {r['over_teacher_words_s']:.1f}x" for r in same) if same else "") + ".")
    for name, tr in training.items():
        out.append(_training_line(name, tr))
    return out


def _training_line(name: str, t: dict) -> str:
    """What stopped a training run, and whether its dev BLEU was still rising then."""
    budget = BUDGETS.get(t["stop_reason"], t["stop_reason"]).format(role="teacher" if name == "teacher" else "student")
    line = f"{name}: {t['steps']} steps, {t['minutes']:.0f} training minutes, stopped by {budget}"
    curve = t["dev_bleu"]
    if curve:
        line += ", dev BLEU " + " -> ".join(f"{b:.1f}" for b in curve)
    if len(curve) < 2:
        return line + " (too few dev evaluations to tell whether it was still rising)."
    if curve[-1] > curve[-2]:
        if t["stop_reason"] == "patience":
            return line + ", rising again at the end."
        return line + f", still rising at the end: {budget} limited it; more would raise it."
    return line + f"; dev BLEU had levelled off ({curve[-1] - curve[-2]:+.1f} at the last evaluation): " \
                  "not the budget; more of the same training would add little."


def _search(r: dict) -> str:
    b = r.get("beam")
    return "-" if b is None else ("greedy" if b == 1 else f"beam {b}")


def markdown(rep: dict) -> str:
    t = rep["test"]
    lines = [f"# Distillation report: {rep['run']}", "",
             f"Test set: {t['sentences']} sentences, {t['words']} source words ({t['pair']})"
             + (f", from {t['set']}" if t.get("set") else "") + f". Machine: {rep['machine']}.", "",
             "| system | BLEU | chrF | words/s | × teacher | search | engine | parameters | size (MB) |",
             "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for r in rep["systems"]:
        params = f"{r['size_params'] / 1e6:.3g} M" if r.get("size_params") else "-"
        size = f"{r['size_bytes'] / 2**20:.3g}" if r.get("size_bytes") else "-"
        ratio = f"{r['over_teacher_words_s']:.2f}" if r.get("over_teacher_words_s") else "-"
        lines.append(f"| {r['system']} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['words_per_second']:.0f} | "
                     f"{ratio} | {_search(r)} | {r['engine']} | {params} | {size} |")
    if rep.get("verdict"):
        lines += [""] + [f"- {v}" for v in rep["verdict"]]
    lines += ["", "Systems:"]
    lines += [f"- {r['system']} ({_search(r)}): {r['description']}" for r in rep["systems"]]
    if not rep["lean_decoder"]:
        lines += ["", "Note: decoder.Translator is not available yet; our models were decoded with the "
                      "reference search in student/distill/beam.py (words/s are not the lean decoder's)."]
    if rep["systems"]:
        lines += ["", f"BLEU: `{rep['systems'][0]['bleu_signature']}`",
                  f"chrF: `{rep['systems'][0]['chrf_signature']}`"]
    lines += ["", "| stage | status | seconds | what ran |", "|---|---|---:|---|"]
    lines += [f"| {k} | {v['status']} | {v['seconds']} | {v.get('note') or ''} |" for k, v in rep["stages"].items()]
    return "\n".join(lines) + "\n"


def load(run_dir: str) -> tuple[dict, str]:
    with open(os.path.join(run_dir, "report.json"), encoding="utf-8") as fh:
        rep = json.load(fh)
    with open(os.path.join(run_dir, "report.md"), encoding="utf-8") as fh:
        return rep, fh.read()
