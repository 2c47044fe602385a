"""The distillation pipeline: data -> teacher -> distill -> corpus -> student (-> baseline) -> shortlists -> report.

    from student.distill import DistillConfig, run
    run(DistillConfig.from_preset("default", name="bible", teacher_cmd="apertium -u eng-spa"))

Every stage is keyed (stages.py), so rerunning skips what is finished and a
changed option reruns only what depends on it. Launched by torchrun, training
is DDP and each rank translates its own shards.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from decoder import durable
from student.distill import report as report_mod
from student.distill.filter import clean_distilled, one_line
from student.distill.shards import assemble, translate_shards
from student.distill.stages import Run, barrier
from student.distill.teachers import TeacherError, dir_digest, make_teacher


@dataclass
class DistillConfig:
    name: str = "default"
    runs_dir: str = "runs"
    preset: str = "default"
    # data: the embedded corpus, or the user's parallel files (see student.data)
    corpus: str = "bible-en-es"
    src: str | None = None
    tgt: str | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None
    vocab_size: int = 8000
    train_limit: int = 0        # first N training pairs only (smoke runs); 0 = all
    test_limit: int = 0         # first N test pairs in the report; 0 = all
    # teacher: one of these, or none to train our own
    teacher_cmd: str | None = None
    teacher_hf: str | None = None
    teacher_model: list = field(default_factory=list)  # model dirs; several = ensemble
    teacher_preset: str = "auto"  # auto: teacher-big on a GPU, teacher-tiny on CPU
    teacher_minutes: float = 60.0
    teacher_steps: int = 0
    teacher_set: dict = field(default_factory=dict)
    teacher_lr: float = 2e-3    # the measured teacher-tiny recipe (docs/training.md)
    teacher_warmup: int = 400
    average_last: int = 4       # average the last N step checkpoints (1 = the best checkpoint)
    teacher_beam: int = 4
    engine: str = "auto"        # auto | decoder | reference (see teachers.ModelTeacher)
    precision: str = "auto"     # the lean decoder's precision for the students in the report
    # distillation
    shard_size: int = 1000
    min_ratio: float = 0.3
    max_ratio: float = 2.5
    max_repeat: int = 4
    mix_original: bool = False  # train the student on distilled + original pairs
    # students
    student_preset: str = "student-tiny"
    student_minutes: float = 40.0
    student_steps: int = 0
    student_set: dict = field(default_factory=dict)
    student_lr: float = 2e-3
    student_warmup: int = 400
    student_beam: int = 1
    baseline_student: bool = False
    # lexical shortlist of each exported student, from the corpus it was trained on (0 = none)
    shortlist_k: int = 100
    shortlist_frequent: int = 100
    # training shared by teacher and students
    max_tokens: int = 3072
    eval_every: int = 400
    save_every: int = 100
    dev_max: int = 300
    patience: int = 0
    amp: str = "auto"
    seed: int = 1

    @classmethod
    def from_preset(cls, preset: str = "default", **overrides) -> "DistillConfig":
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        return cls(preset=preset, **{**PRESETS[preset], **overrides})


PRESETS = {
    # 2 CPU cores, about two hours: teacher-tiny 60 min, distill ~15 min, student-tiny 40 min
    "default": {},
    # one GPU: transformer-big teacher, 12-1 student, 32k vocabulary (days, not hours)
    "wmt": dict(teacher_preset="teacher-big", vocab_size=32000, teacher_minutes=0.0, teacher_steps=100_000,
                teacher_lr=7e-4, teacher_warmup=4000, max_tokens=16384, eval_every=2000, save_every=1000,
                dev_max=0, patience=10, shard_size=20_000, student_preset="student-12-1", student_minutes=0.0,
                student_steps=100_000, student_lr=7e-4, student_warmup=4000, baseline_student=True),
}


def _dist_setup() -> tuple[int, int]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # distillation ranks finish their shards at different times: a long barrier timeout
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(hours=12))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _log(rank):
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)


def _read(path):
    from student.data import read_lines
    return read_lines(path)[0]


def _write(path, lines):
    durable.write_lines(path, lines)


def check(cfg: DistillConfig) -> None:
    teachers = [x for x in (cfg.teacher_cmd, cfg.teacher_hf, cfg.teacher_model) if x]
    if len(teachers) > 1:
        raise TeacherError("give at most one of --teacher-cmd, --teacher-hf, --teacher-model")
    if not teachers and not (cfg.teacher_minutes or cfg.teacher_steps):
        raise ValueError("training our own teacher needs a budget: --teacher-minutes or --teacher-steps")
    if not (cfg.student_minutes or cfg.student_steps):
        raise ValueError("the student needs a budget: --student-minutes or --student-steps")
    if bool(cfg.src) != bool(cfg.tgt):
        raise ValueError("--src and --tgt go together")
    if cfg.shard_size < 1:
        raise ValueError("--shard-size must be at least 1")
    if cfg.shortlist_k < 0 or cfg.shortlist_frequent < 0:
        raise ValueError("--shortlist-k and --shortlist-frequent must be >= 0")


def run(cfg: DistillConfig, verbose: bool = True) -> dict:
    """Run or resume the pipeline; returns the report (as written to runs/<name>/report.json)."""
    from student.data import prepare
    from student.export import export_checkpoint
    from student.train import TrainConfig, train
    from student.train.average import average, last_checkpoints

    check(cfg)
    rank, world = _dist_setup()
    log = _log(rank) if verbose else (lambda msg: None)
    runner = Run(os.path.join(cfg.runs_dir, cfg.name), dataclasses.asdict(cfg), rank, log)
    on_gpu = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if on_gpu else "cpu"
    teacher = None
    if cfg.teacher_cmd or cfg.teacher_hf or cfg.teacher_model:  # a plugged-in teacher fails before any work
        teacher = make_teacher(cmd=cfg.teacher_cmd, hf_dir=cfg.teacher_hf, model_dirs=cfg.teacher_model,
                               beam=cfg.teacher_beam, engine=cfg.engine, device=device)
    data_args = dict(corpus=cfg.corpus, src=cfg.src, tgt=cfg.tgt, src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang,
                     vocab_size=cfg.vocab_size)

    # data: the prepared corpus is cached by student.data; the stage fixes the training slice
    if rank == 0:
        prep = prepare(**data_args, verbose=verbose)
    barrier()
    if rank != 0:
        prep = prepare(**data_args, verbose=False)
    if rank == 0:
        with open(os.path.join(prep.dir, "prepared.json"), encoding="utf-8") as fh:
            inputs = json.load(fh)["inputs"]
        runner.manifest["inputs"] = {"prepared": os.path.basename(prep.dir),
                                     **{role: _digest(p) for role, p in inputs.items()}}

    def data_work(d):
        if rank == 0:
            src, tgt = prep.read("train")
            n = cfg.train_limit or len(src)
            _write(f"{d}/train.src", (one_line(x) for x in src[:n]))
            _write(f"{d}/train.tgt", (one_line(x) for x in tgt[:n]))
        return None

    data_key, data_dir, _ = runner.stage(
        "data", {"prepared": os.path.basename(prep.dir), "train_limit": cfg.train_limit}, [], data_work,
        finish=lambda d: {"train_pairs": len(_read(f"{d}/train.src")), "prepared": prep.dir,
                          "langs": [prep.src_lang, prep.tgt_lang]})
    train_src, train_tgt = f"{data_dir}/train.src", f"{data_dir}/train.tgt"

    def train_cfg(out, preset, overrides, steps, minutes, lr, warmup, tsrc, ttgt, keep_last):
        return TrainConfig(out_dir=out, preset=preset, model_overrides=overrides, **data_args,
                           train_src=tsrc, train_tgt=ttgt, max_tokens=cfg.max_tokens, lr=lr, warmup=warmup,
                           amp=cfg.amp, seed=cfg.seed, max_steps=steps, max_minutes=minutes,
                           patience=cfg.patience, eval_every=cfg.eval_every, dev_max=cfg.dev_max,
                           save_every=cfg.save_every, keep_last=keep_last, test_at_end=False)

    # teacher
    upstream_teacher = []
    teacher_dirs = []
    if teacher is None:
        preset = cfg.teacher_preset if cfg.teacher_preset != "auto" else ("teacher-big" if on_gpu else "teacher-tiny")
        opts = {"preset": preset, "set": cfg.teacher_set, "steps": cfg.teacher_steps,
                "minutes": cfg.teacher_minutes, "lr": cfg.teacher_lr, "warmup": cfg.teacher_warmup,
                "average_last": cfg.average_last, **_train_shared(cfg)}

        def teacher_work(d):
            train(train_cfg(f"{d}/train", preset, cfg.teacher_set, cfg.teacher_steps, cfg.teacher_minutes,
                            cfg.teacher_lr, cfg.teacher_warmup, train_src, train_tgt, max(cfg.average_last, 2)))

        def teacher_finish(d):
            ck, averaged = f"{d}/train/best.pt", []
            if cfg.average_last > 1:
                try:
                    paths = last_checkpoints(f"{d}/train", cfg.average_last)
                    ck = average(paths, f"{d}/averaged.pt")
                    averaged = [os.path.basename(p) for p in paths]
                except FileNotFoundError:
                    log("[teacher] no step checkpoints to average (no evaluation ran); exporting best.pt")
            export_checkpoint(ck, f"{d}/model")
            with open(f"{d}/train/metrics.json") as fh:
                m = json.load(fh)
            return {"model_dir": f"{d}/model", "averaged_from": averaged, "preset": preset,
                    **{k: m[k] for k in ("stop_reason", "step", "train_minutes", "best_dev_bleu")}}

        tkey, tdir, _ = runner.stage("teacher", opts, [data_key], teacher_work, teacher_finish)
        upstream_teacher, teacher_dirs = [tkey], [f"{tdir}/model"]
        runner.link("teacher-model", f"{tdir}/model")

    if teacher is None:
        teacher = make_teacher(model_dirs=teacher_dirs, beam=cfg.teacher_beam, engine=cfg.engine, device=device)
    if rank == 0 and (cfg.teacher_model or cfg.teacher_hf):
        runner.manifest["inputs"]["teacher"] = teacher.identity

    # distill: each rank its own shards; rank 0 assembles once all are through
    src_lines = _read(train_src)

    def distill_work(d):
        return translate_shards(teacher, src_lines, f"{d}/shards", cfg.shard_size, rank, world,
                                verbose=verbose and rank == 0)

    def distill_finish(d):
        hyp = assemble(f"{d}/shards", len(src_lines), cfg.shard_size)
        _write(f"{d}/distilled.txt", hyp)
        return {"sentences": len(hyp), "shards": len(os.listdir(f"{d}/shards")), "teacher": teacher.name,
                "world": world}

    dkey, ddir, _ = runner.stage("distill", {"teacher": teacher.identity, "shard_size": cfg.shard_size},
                                 [data_key] + upstream_teacher, distill_work, distill_finish)

    # corpus: clean the teacher's output, optionally add the original pairs
    def corpus_finish(d):
        s, h, counts = clean_distilled(src_lines, _read(f"{ddir}/distilled.txt"), cfg.min_ratio,
                                       cfg.max_ratio, cfg.max_repeat)
        if not s:
            raise TeacherError(f"nothing left of the distilled corpus after cleaning ({counts}); "
                               f"look at {ddir}/distilled.txt")
        if cfg.mix_original:
            s = s + src_lines
            h = h + [one_line(x) for x in _read(train_tgt)]
        _write(f"{d}/train.src", s)
        _write(f"{d}/train.tgt", h)
        return {"removed": {k: v for k, v in counts.items() if k != "kept"}, "distilled_kept": counts["kept"],
                "pairs": len(s), "mixed_original": cfg.mix_original}

    ckey, cdir, _ = runner.stage("corpus", {"min_ratio": cfg.min_ratio, "max_ratio": cfg.max_ratio,
                                            "max_repeat": cfg.max_repeat, "mix_original": cfg.mix_original},
                                 [dkey], lambda d: None, corpus_finish)

    # students: the KD student, and with baseline_student the same recipe on the original pairs
    sopts = {"preset": cfg.student_preset, "set": cfg.student_set, "steps": cfg.student_steps,
             "minutes": cfg.student_minutes, "lr": cfg.student_lr, "warmup": cfg.student_warmup,
             **_train_shared(cfg)}

    def student_stage(name, tsrc, ttgt, upstream):
        def work(d):
            train(train_cfg(f"{d}/train", cfg.student_preset, cfg.student_set, cfg.student_steps,
                            cfg.student_minutes, cfg.student_lr, cfg.student_warmup, tsrc, ttgt, 2))

        def finish(d):
            export_checkpoint(f"{d}/train/best.pt", f"{d}/model")
            with open(f"{d}/train/metrics.json") as fh:
                m = json.load(fh)
            return {"model_dir": f"{d}/model", **{k: m[k] for k in ("stop_reason", "step", "train_minutes",
                                                                    "best_dev_bleu")}}

        key, d, _ = runner.stage(name, sopts, upstream, work, finish)
        runner.link(f"{name}-model", f"{d}/model")
        return key, f"{d}/model"

    def shortlist_stage(stage, model_dir, tsrc, ttgt, upstream):
        from student.shortlist import add_to_model_dir
        opts = {"k": cfg.shortlist_k, "frequent": cfg.shortlist_frequent}

        def build(d):
            return add_to_model_dir(model_dir, tsrc, ttgt, k=cfg.shortlist_k, n_frequent=cfg.shortlist_frequent)

        runner.stage(stage, opts, upstream, lambda d: None, build)
        # the file lives in the student's model dir, which every shortlist key shares:
        # a reused stage may find another key's file there, so rebuild that one
        if rank == 0 and _shortlist_options(model_dir) != opts:
            log(f"[{stage}] {model_dir} holds another shortlist; rebuilding")
            build(None)
        barrier()

    skey, student_dir = student_stage("student", f"{cdir}/train.src", f"{cdir}/train.tgt", [ckey])
    systems = [("teacher", teacher, upstream_teacher or [dkey]), ("student", student_dir, [skey])]
    if cfg.shortlist_k:
        shortlist_stage("shortlist", student_dir, f"{cdir}/train.src", f"{cdir}/train.tgt", [skey, ckey])
    if cfg.baseline_student:
        bkey, bdir = student_stage("baseline", train_src, train_tgt, [data_key])
        systems.append(("baseline", bdir, [bkey]))
        if cfg.shortlist_k:
            shortlist_stage("shortlist-baseline", bdir, train_src, train_tgt, [bkey, data_key])

    # report
    ropts = {"test_limit": cfg.test_limit, "teacher_beam": cfg.teacher_beam, "student_beam": cfg.student_beam,
             "engine": cfg.engine, "precision": cfg.precision, "teacher": teacher.identity}
    upstream = [k for _, _, keys in systems for k in keys]
    rkey, rdir, _ = runner.stage(
        "report", ropts, upstream, lambda d: None,
        lambda d: report_mod.evaluate(d, prep, systems, cfg, runner.manifest, log))
    result = None
    if rank == 0:
        for f in ("report.md", "report.json"):
            shutil.copyfile(f"{rdir}/{f}", os.path.join(runner.dir, f))
        with open(f"{rdir}/report.json", encoding="utf-8") as fh:
            result = json.load(fh)
    barrier()
    return result


def _train_shared(cfg):
    return {k: getattr(cfg, k) for k in ("max_tokens", "eval_every", "save_every", "dev_max", "patience",
                                         "amp", "seed", "vocab_size")}


def _shortlist_options(model_dir) -> dict | None:
    """{"k", "frequent"} the model dir's shortlist was built with (its safetensors metadata)."""
    from safetensors import SafetensorError, safe_open

    from decoder import modeldir
    try:
        cfg = modeldir.read_config(model_dir)
        with safe_open(os.path.join(model_dir, cfg.shortlist or modeldir.SHORTLIST), "pt") as fh:
            meta = fh.metadata() or {}
        return {"k": int(meta["k"]), "frequent": int(meta["frequent"])}
    except (OSError, KeyError, ValueError, SafetensorError, modeldir.ModelDirError):
        return None


def _digest(path):
    from student.distill.teachers import dir_digest_file
    return dir_digest_file(path) if os.path.isfile(path) else None
