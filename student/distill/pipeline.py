"""The distillation pipeline: data -> teacher -> distill -> corpus -> student (-> baseline) -> shortlists -> report.

    from student.distill import DistillConfig, run
    run(DistillConfig.from_preset("default", name="bible", teacher_cmd="apertium -u eng-spa"))

Every stage is keyed (stages.py), so rerunning skips what is finished and a
changed option reruns only what depends on it. Launched by torchrun, training
is DDP and each rank translates its own shards.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import sentencepiece as spm
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from decoder import durable, modeldir
from decoder.machine import device_kind
from student import chart
from student.data import prepare
from student.data.corpus import Lines
from student.data.pipeline import file_digest
from student.distill import report as report_mod
from student.distill import side
from student.distill.filter import iter_clean_distilled, one_line
from student.distill.shards import count_lines, iter_assembled, translate_shards
from student.distill.stages import Run, barrier
from student.distill.teachers import TeacherError, make_teacher
from student.export import export_checkpoint
from student.model import preset
from student.shortlist import add_to_model_dir
from student.train import TrainConfig, train
from student.train import sizing
from student.train.trainer import DIST_TIMEOUT
from student.train.average import candidates, choose, dev_bleu, materialise
from student.train.init import InitError, compatible


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
    dev_src: str | None = None  # the user's own dev and test pairs (default: the corpus' splits)
    dev_tgt: str | None = None
    test_src: str | None = None
    test_tgt: str | None = None
    vocab_size: int = TrainConfig.vocab_size
    train_limit: int = 0        # first N training pairs only (smoke runs); 0 = all
    test_limit: int = 0         # first N test pairs in the report; 0 = all
    # teacher: one of these, or none to train our own
    teacher_cmd: str | None = None
    teacher_hf: str | None = None
    teacher_model: list = field(default_factory=list)  # model dirs; several = ensemble
    teacher_preset: str = "auto"  # auto: AUTO_TEACHER's entry for the device (teacher-tiny on CPU)
    teacher_minutes: float = 60.0
    teacher_steps: int = 0
    teacher_set: dict = field(default_factory=dict)
    # lr, warmup, batch size, precision, seed: student.train's defaults (None: the device's, sizing.py),
    # on CPU the measured teacher-tiny recipe (docs/training.md), for the teacher and the students alike
    teacher_lr: float | None = TrainConfig.lr
    teacher_warmup: int | None = TrainConfig.warmup
    average_last: int = 4       # the teacher's export candidates average up to N recent step checkpoints
    teacher_beam: int = 4
    engine: str = "auto"        # auto | decoder | reference (see teachers.ModelTeacher)
    precision: str = "auto"     # the lean decoder's precision for the students in the report
    # distillation
    shard_size: int = 1000
    min_ratio: float = 0.3
    max_ratio: float = 2.5
    max_repeat: int = 4
    mix_original: bool = False  # train the student on distilled + original pairs
    # a stage whose output collapsed stops the run (neither is part of a stage key: the stages stay
    # cached, and a rerun with a lower floor goes on from them). A teacher below this dev BLEU did
    # not learn (a 4-minute teacher-tiny: 0.47; the default one-hour run: 28)
    min_teacher_bleu: float = 1.0
    # the least share of the distilled pairs that cleaning keeps, without --mix-original (the
    # default run keeps 98%; the 4-minute teacher's output kept 1 pair of 8,000)
    min_kept: float = 0.5
    # students
    student_preset: str = "student-tiny"
    student_minutes: float = 40.0
    student_steps: int = 0
    student_set: dict = field(default_factory=dict)
    student_lr: float | None = TrainConfig.lr
    student_warmup: int | None = TrainConfig.warmup
    student_beam: int = 1
    student_init: str = "auto"  # teacher | random | auto: teacher where our teacher's model dir maps
    baseline_student: bool = False
    side_by_side: bool = True   # student and baseline at once, one pinned core set each (CPU, one rank)
    # lexical shortlist of each exported student, from the corpus it was trained on (0 = none)
    shortlist_k: int = 100
    shortlist_frequent: int = 100
    # training shared by teacher and students
    max_tokens: int | None = TrainConfig.max_tokens
    eval_every: int = 400       # and 300 dev sentences: evaluation time fits the two-hour run
    save_every: int = TrainConfig.save_every
    dev_max: int = 300
    patience: int = 0
    amp: str = TrainConfig.amp
    seed: int = TrainConfig.seed

    @classmethod
    def from_preset(cls, preset: str = "default", device: str | None = None, **overrides) -> "DistillConfig":
        """The preset's config; `default` with DEVICE_DEFAULTS' entry for `device` (cpu | cuda; default:
        cuda where torch sees a GPU) under it. Every override wins."""
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        device = device or device_kind()
        on_device = DEVICE_DEFAULTS[device] if preset == "default" else {}
        return cls(preset=preset, **{**PRESETS[preset], **on_device, **overrides})


PRESETS = {
    # 2 CPU cores, about two hours: teacher-tiny 60 min, distill ~15 min, student-tiny 40 min
    "default": {},
    # one GPU: transformer-big teacher, 12-1 student, 32k vocabulary (days, not hours)
    "wmt": dict(teacher_preset="teacher-big", vocab_size=32000, teacher_minutes=0.0, teacher_steps=100_000,
                teacher_lr=7e-4, teacher_warmup=4000, max_tokens=16384, eval_every=2000, save_every=1000,
                dev_max=0, patience=10, shard_size=20_000, student_preset="student-12-1", student_minutes=0.0,
                student_steps=100_000, student_lr=7e-4, student_warmup=4000, baseline_student=True,
                amp="auto"),  # bf16 autocast on CUDA (fp16 with a gradient scaler where the GPU lacks bf16)
}

# The teacher `--teacher-preset auto` trains, one entry per device kind: (preset, model overrides under
# --teacher-set). CPU: teacher-tiny, measured (docs/training.md: 17.9 test BLEU in 1,500 steps on 2 cores).
# CUDA, chosen from evidence, not yet measured: teacher-big learned nothing useful in its budget on the
# H100 (dev BLEU 3.0 after 1,040 steps of 3,072 tokens: 184 M parameters, 3 epochs of 29k pairs);
# teacher-base (d 512, 6+6 layers, 48 M) costs about 1.8x student-6-1's training FLOPs a token, and
# student-6-1 trained at 330-420k tokens/s on the H200 (bf16, 24k-token batches; docs/bench/gpu.md), so
# teacher-base should run at 150-230k on an H100 or H200: 6 minutes are some 60-90 epochs of the Bible
# corpus (about 0.9 M target tokens), more than the CPU teacher's 27 (24.6 test BLEU); dropout 0.3 because
# that many epochs of 29k pairs overfit a model of that size (Araabi & Monz 2020, "Optimizing Transformer
# for low-resource NMT": 0.3 best at this data size). Its d 512 and 6 encoder layers map onto student-6-1
# (student/train/init.py), so the student starts from it.
# Measured since (H200, 2026-11-28, docs/bench/gpu.md): 3,068 steps in its 6 minutes at about 220k tokens/s,
# dev BLEU 24.26 (the last four checkpoints averaged) against the CPU teacher's 28.41 on the same dev
# sentences: behind it, the dev loss lowest at 55 of 71 epochs. Next to measure: teacher-tiny at the GPU's
# batches (`--teacher-preset teacher-tiny`), before this entry changes.
# Re-measure: tools/gpu_session.sh runs the default `make distill` on a GPU and records its report.
AUTO_TEACHER = {
    "cpu": ("teacher-tiny", {}),
    "cuda": ("teacher-base", {"dropout": 0.3}),
}

# What the `default` preset changes per device kind (DistillConfig's own values are the CPU's).
# CUDA: the target is the whole `make distill` in 20 minutes on one H100; the budgets are sized so that
# it ends in about 12, which a lent GPU session (15 minutes of machine time, start and build included)
# can measure end to end: teacher 6 + student 3 training minutes, the rest for evaluations, the
# distillation (29k lines, beam 4, GPU batches), export and report. student-6-1 (the GPU benchmark's
# model) starts from teacher-base's weights; at ~300k tokens/s, 3 minutes are some 60 epochs of the
# distilled corpus. None: the trainer's GPU sizes (student/train/sizing.py). Checkpoints every 200
# steps, not 100: at 8x the CPU's tokens a step, a 580 MB teacher-base checkpoint every 100 steps
# costs budget.
DEVICE_DEFAULTS = {
    "cpu": {},
    "cuda": dict(teacher_minutes=6.0, student_minutes=3.0, student_preset="student-6-1", save_every=200),
}


def teacher_choice(teacher_preset: str, teacher_set: dict, device: str) -> tuple[str, dict]:
    """(preset, model overrides) of our own teacher: `auto` is AUTO_TEACHER's entry for the device
    kind, its overrides under the user's --teacher-set."""
    if teacher_preset != "auto":
        return teacher_preset, dict(teacher_set)
    name, sets = AUTO_TEACHER["cuda" if device.startswith("cuda") else "cpu"]
    return name, {**sets, **teacher_set}


def _dist_setup() -> tuple[int, int]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # distillation ranks finish their shards at different times: a long barrier timeout
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=DIST_TIMEOUT)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# TrainConfig fields left out of a training stage's key, as they cannot change the model it
# trains: where it writes, and input paths whose content the upstream stages' keys fix
# (the data stage keys the prepared corpus by content; teacher/corpus stages their files)
NOT_IN_STAGE_KEY = ("out_dir", "train_src", "train_tgt", "src", "tgt", "init_from")


def train_stage_options(tc: TrainConfig, **extra) -> dict:
    """A training stage's key options: every TrainConfig field but NOT_IN_STAGE_KEY, so any
    training option a later version adds is keyed without being listed here."""
    opts = {k: v for k, v in dataclasses.asdict(tc).items() if k not in NOT_IN_STAGE_KEY}
    return {"train": opts, **extra}


def data_args(cfg: DistillConfig) -> dict:
    return dict(corpus=cfg.corpus, src=cfg.src, tgt=cfg.tgt, src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang,
                dev_src=cfg.dev_src, dev_tgt=cfg.dev_tgt, test_src=cfg.test_src, test_tgt=cfg.test_tgt,
                vocab_size=cfg.vocab_size)


def train_config(cfg: DistillConfig, role: str, preset: str, train_src: str, train_tgt: str,
                 device: str = "cpu", overrides: dict | None = None) -> TrainConfig:
    """What the teacher (role "teacher") or a student ("student") trains with: the role's recipe
    (cfg.<role>_set or `overrides`, _steps, _minutes, _lr, _warmup), the options they share and the
    run's data. On CPU the batch, lr and warm-up left to the device are filled in here (the stage key
    names the values, as before); on CUDA they stay None and the trainer sizes them for the GPU it
    finds. out_dir is the stage dir's, set when the stage runs (it is no part of the key)."""
    r = {k: getattr(cfg, f"{role}_{k}") for k in ("set", "steps", "minutes", "lr", "warmup")}
    sizes = dict(max_tokens=cfg.max_tokens, max_sentences=None, lr=r["lr"], warmup=r["warmup"])
    if not device.startswith("cuda"):
        s = sizing.resolve("cpu", None, None, **sizes)
        sizes = dict(max_tokens=s.max_tokens, max_sentences=s.max_sentences, lr=s.lr, warmup=s.warmup)
    return TrainConfig(out_dir="", preset=preset, model_overrides=r["set"] if overrides is None else overrides,
                       **data_args(cfg), train_src=train_src, train_tgt=train_tgt, **sizes, amp=cfg.amp,
                       seed=cfg.seed, max_steps=r["steps"], max_minutes=r["minutes"], patience=cfg.patience,
                       eval_every=cfg.eval_every, dev_max=cfg.dev_max, save_every=cfg.save_every,
                       keep_last=max(cfg.average_last, 2) if role == "teacher" else 2, test_at_end=False)


def _log(rank, verbose):
    if rank == 0 and verbose:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    return lambda msg: None


def _write_pairs(src_path: str, tgt_path: str, pairs) -> int:
    """Both sides of a stream of pairs into two files, each replaced whole (durable); returns the count."""
    n = [0]

    def write(tmp_src):
        def both(tmp_tgt):
            with open(tmp_src, "w", encoding="utf-8", newline="\n") as fs, \
                    open(tmp_tgt, "w", encoding="utf-8", newline="\n") as ft:
                for s, t in pairs:
                    fs.write(s + "\n")
                    ft.write(t + "\n")
                    n[0] += 1
        durable.atomic_write(tgt_path, both)
    durable.atomic_write(src_path, write)
    return n[0]


class StageCollapsed(ValueError):
    """A stage's output is too small a part of its input for the next stage to learn from."""


def _exported_bleu(result: dict) -> float:
    """The dev BLEU of the teacher the teacher stage exported."""
    export = result["export"]
    return next(c["dev_bleu"] for c in export["candidates"] if c["name"] == export["chosen"])


def _training_result(d: str, **more) -> dict:
    with open(f"{d}/train/metrics.json") as fh:
        m = json.load(fh)
    return {"model_dir": f"{d}/model", **more,
            **{k: m[k] for k in ("stop_reason", "step", "train_minutes", "best_dev_bleu")}}


NOT_OURS = "the teacher is not one model dir of ours (a command, an HF model or an ensemble)"


def check(cfg: DistillConfig) -> None:
    teachers = [x for x in (cfg.teacher_cmd, cfg.teacher_hf, cfg.teacher_model) if x]
    if len(teachers) > 1:
        raise TeacherError("give at most one of --teacher-cmd, --teacher-hf, --teacher-model")
    if not teachers and not (cfg.teacher_minutes or cfg.teacher_steps):
        raise ValueError("training our own teacher needs a budget: --teacher-minutes or --teacher-steps")
    if not (cfg.student_minutes or cfg.student_steps):
        raise ValueError("the student needs a budget: --student-minutes or --student-steps")
    for x in ("", "dev_", "test_"):
        if bool(getattr(cfg, f"{x}src")) != bool(getattr(cfg, f"{x}tgt")):
            raise ValueError(f"--{x.replace('_', '-')}src and --{x.replace('_', '-')}tgt go together")
    if cfg.shard_size < 1:
        raise ValueError("--shard-size must be at least 1")
    if cfg.student_init not in ("auto", "teacher", "random"):
        raise ValueError(f"--student-init must be auto, teacher or random, not {cfg.student_init!r}")
    if cfg.student_init == "teacher" and (cfg.teacher_cmd or cfg.teacher_hf or len(cfg.teacher_model) > 1):
        raise InitError(f"--student-init teacher: {NOT_OURS}")
    if cfg.shortlist_k < 0 or cfg.shortlist_frequent < 0:
        raise ValueError("--shortlist-k and --shortlist-frequent must be >= 0")


def run(cfg: DistillConfig, verbose: bool = True) -> dict:
    """Run or resume the pipeline; returns the report (as written to runs/<name>/report.json)."""
    p = Pipeline(cfg, verbose)
    data_key, train_src, train_tgt = p.data()
    upstream_teacher = []
    teacher_dir = cfg.teacher_model[0] if len(cfg.teacher_model) == 1 else None
    if p.teacher is None:
        tkey, teacher_dir = p.own_teacher(data_key, train_src, train_tgt)
        p.teacher = make_teacher(model_dirs=[teacher_dir], beam=cfg.teacher_beam, engine=cfg.engine,
                                 device=p.device, world=p.world)
        upstream_teacher = [tkey]
    p.record_teacher()
    p.choose_student_init(teacher_dir)
    dkey, ddir = p.distill(train_src, [data_key] + upstream_teacher)
    ckey, cdir = p.corpus(train_src, train_tgt, dkey, ddir)
    # students: the KD student, and with baseline_student the same recipe on the original pairs
    jobs = [("student", f"{cdir}/train.src", f"{cdir}/train.tgt", [ckey])]
    if cfg.baseline_student:
        jobs.append(("baseline", train_src, train_tgt, [data_key]))
    trained = p.students(jobs)
    skey, student_dir = trained["student"]
    systems = [("teacher", p.teacher, upstream_teacher or [dkey]), ("student", student_dir, [skey])]
    if cfg.shortlist_k:
        p.shortlist("shortlist", student_dir, f"{cdir}/train.src", f"{cdir}/train.tgt", [skey, ckey])
    if cfg.baseline_student:
        bkey, bdir = trained["baseline"]
        systems.append(("baseline", bdir, [bkey]))
        if cfg.shortlist_k:
            p.shortlist("shortlist-baseline", bdir, train_src, train_tgt, [bkey, data_key])
    return p.report(systems)


class Pipeline:
    """One run's steps (each a keyed stage, stages.py) and what they share: the config, this
    process's rank, the stage runner, the prepared corpus and the teacher."""

    def __init__(self, cfg: DistillConfig, verbose: bool):
        check(cfg)
        self.cfg, self.verbose = cfg, verbose
        self.rank, self.world = _dist_setup()
        self.log = _log(self.rank, verbose)
        self.runner = Run(os.path.join(cfg.runs_dir, cfg.name), dataclasses.asdict(cfg), self.rank, self.log)
        self.on_gpu = device_kind() == "cuda"
        self.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if self.on_gpu else "cpu"
        self.teacher, self.teacher_bleu = None, None
        if cfg.teacher_cmd or cfg.teacher_hf or cfg.teacher_model:  # a plugged-in teacher fails before any work
            self.teacher = make_teacher(cmd=cfg.teacher_cmd, hf_dir=cfg.teacher_hf, model_dirs=cfg.teacher_model,
                                        beam=cfg.teacher_beam, engine=cfg.engine, device=self.device,
                                        world=self.world)
        self.prep = self._prepare()
        if hasattr(self.teacher, "set_languages"):  # a multilingual HF teacher needs the pair
            self.teacher.set_languages(self.prep.src_lang, self.prep.tgt_lang)

    def _prepare(self):
        """The prepared corpus (cached by student.data; rank 0 builds it); its inputs go to the manifest."""
        if self.rank == 0:
            prep = prepare(**data_args(self.cfg), verbose=self.verbose)
        barrier()
        if self.rank != 0:
            prep = prepare(**data_args(self.cfg), verbose=False)
        if self.rank == 0:
            with open(os.path.join(prep.dir, "prepared.json"), encoding="utf-8") as fh:
                inputs = json.load(fh)["inputs"]
            self.runner.manifest["inputs"] = {"prepared": os.path.basename(prep.dir),
                                              **{role: _digest(p) for role, p in inputs.items()}}
        return prep

    def data(self) -> tuple[str, str, str]:
        """The training slice of the prepared corpus: (key, train.src, train.tgt)."""
        prep, limit = self.prep, self.cfg.train_limit

        def work(d):
            if self.rank == 0:  # streamed: the corpus may be far larger than memory
                for path, side in zip(prep.splits["train"], ("src", "tgt")):
                    durable.write_lines(f"{d}/train.{side}",
                                        (one_line(x) for x in itertools.islice(Lines(path), limit or None)))

        def finish(d):
            return {"train_pairs": count_lines(f"{d}/train.src"), "prepared": prep.dir,
                    "langs": [prep.src_lang, prep.tgt_lang]}

        key, d, _ = self.runner.stage("data", {"prepared": os.path.basename(prep.dir), "train_limit": limit},
                                      [], work, finish)
        return key, f"{d}/train.src", f"{d}/train.tgt"

    def own_teacher(self, data_key: str, train_src: str, train_tgt: str) -> tuple[str, str]:
        """Train, average and export our own teacher: (key, model dir)."""
        cfg = self.cfg
        preset, sets = teacher_choice(cfg.teacher_preset, cfg.teacher_set, self.device)
        tc = train_config(cfg, "teacher", preset, train_src, train_tgt, self.device, sets)

        def finish(d):
            export = self.export_best(f"{d}/train", f"{d}/model")
            return _training_result(d, averaged_from=export["averaged_from"], export=export, preset=preset)

        key, d = self._train_stage("teacher", tc, [data_key], finish, average_last=cfg.average_last,
                                   export="best dev BLEU of last.pt and recent averages")
        self.runner.link("teacher-model", f"{d}/model")
        r = self.runner.manifest["stages"]["teacher"]["result"]
        self.teacher_bleu = _exported_bleu(r)
        if self.teacher_bleu < cfg.min_teacher_bleu:
            raise StageCollapsed(
                f"the teacher's dev BLEU is {self.teacher_bleu:.2f}, below --min-teacher-bleu "
                f"{cfg.min_teacher_bleu:g}: it did not learn in {r['step']:,} steps ({r['train_minutes']} "
                f"minutes); give it a longer budget (--teacher-minutes, --teacher-steps) or plug one in "
                f"(--teacher-model, --teacher-cmd); the stages done are kept for the rerun")
        return key, f"{d}/model"

    def export_best(self, run_dir: str, out_dir: str) -> dict:
        """Export the candidate (average.candidates: the final weights, averages of the
        recent step checkpoints ending at the final step, best.pt) with the best greedy
        dev BLEU; returns every candidate with its score and the choice."""
        src, ref = self.prep.read("dev")
        n = self.cfg.dev_max or len(src)
        work = os.path.join(os.path.dirname(run_dir), "candidates")
        os.makedirs(work, exist_ok=True)
        files = {}

        def scorer(c):
            files[c["name"]] = materialise(c, work)
            bleu = dev_bleu(files[c["name"]], src[:n], ref[:n], work)
            self.log(f"[teacher] candidate {c['name']} (steps {', '.join(map(str, c['steps']))}): dev BLEU {bleu:.2f}")
            return bleu

        best, scored = choose(candidates(run_dir, self.cfg.average_last), scorer)
        export_checkpoint(files[best["name"]], out_dir)
        self.log(f"[teacher] exporting {best['name']}")
        return {"chosen": best["name"], "dev_sentences": len(src[:n]),
                "averaged_from": [os.path.basename(p) for p in best["paths"]] if len(best["paths"]) > 1 else [],
                "candidates": [{k: c[k] for k in ("name", "steps", "dev_bleu")} for c in scored]}

    def _train_stage(self, name: str, tc: TrainConfig, upstream: list[str], finish, trained: bool = False,
                     **extra) -> tuple[str, str]:
        """A stage that trains exactly `tc` (in its dir's train/; already `trained` there by a side-by-side
        process), keyed by train_stage_options(tc)."""
        def work(d):
            if not trained:
                train(dataclasses.replace(tc, out_dir=f"{d}/train"))

        key, d, _ = self.runner.stage(name, train_stage_options(tc, **extra), upstream, work, finish)
        return key, d

    def record_teacher(self):
        if self.rank == 0 and (self.cfg.teacher_model or self.cfg.teacher_hf):
            self.runner.manifest["inputs"]["teacher"] = self.teacher.identity

    def choose_student_init(self, teacher_dir: str | None):
        """Where the students start (cfg.student_init, resolved): the teacher's weights when its
        model dir maps onto the student preset (student/train/init.py), else random, saying why."""
        cfg, why = self.cfg, None
        if cfg.student_init == "random":
            why = "--student-init random"
        elif teacher_dir is None:
            why = NOT_OURS
        else:
            vocab = spm.SentencePieceProcessor(model_file=self.prep.spm_model).get_piece_size()
            student = preset(cfg.student_preset, vocab_size=vocab, **cfg.student_set)
            why = compatible(student, teacher_dir, self.prep.spm_model)
        if why and cfg.student_init == "teacher":
            raise InitError(f"--student-init teacher: {why}")
        if why:
            self.init = {"mode": "random", "reason": why}
            if cfg.student_init == "auto":
                self.log(f"[student] random initialisation: {why}")
        else:
            self.init = {"mode": "teacher", "from": os.path.abspath(teacher_dir)}
        if self.rank == 0:
            self.runner.manifest["student_init"] = self.init
            self.runner.save()

    def distill(self, train_src: str, upstream: list[str]) -> tuple[str, str]:
        """The teacher's translation of the training source (a file, read a shard at a time): each
        rank its own shards, rank 0 assembles once all are through. (key, dir holding distilled.txt)"""
        cfg, teacher, speed = self.cfg, self.teacher, {}

        def work(d):
            teacher.load()  # loading (and starting worker processes) is not translation speed
            speed.update(translate_shards(teacher, train_src, f"{d}/shards", cfg.shard_size, self.rank,
                                          self.world, verbose=self.verbose and self.rank == 0))
            if hasattr(teacher, "close"):  # its worker processes would sit on memory while students train
                teacher.close()

        def finish(d):
            n = count_lines(train_src)
            durable.write_lines(f"{d}/distilled.txt", iter_assembled(f"{d}/shards", n, cfg.shard_size))
            return {"sentences": n, "shards": len(os.listdir(f"{d}/shards")), "teacher": teacher.name,
                    "world": self.world, **_decoding(teacher), "rank0": speed}

        key, d, _ = self.runner.stage("distill", {"teacher": teacher.identity, "shard_size": cfg.shard_size},
                                      upstream, work, finish)
        return key, d

    def corpus(self, train_src: str, train_tgt: str, dkey: str, ddir: str) -> tuple[str, str]:
        """The teacher's output cleaned, optionally with the original pairs added: (key, dir).
        Streamed pair by pair into the two files."""
        cfg = self.cfg
        opts = {"min_ratio": cfg.min_ratio, "max_ratio": cfg.max_ratio, "max_repeat": cfg.max_repeat,
                "mix_original": cfg.mix_original}

        def finish(d):
            counts = {}
            kept = iter_clean_distilled(zip(Lines(train_src), Lines(f"{ddir}/distilled.txt")), counts,
                                        cfg.min_ratio, cfg.max_ratio, cfg.max_repeat)
            original = zip(Lines(train_src), (one_line(x) for x in Lines(train_tgt))) if cfg.mix_original else ()
            n = _write_pairs(f"{d}/train.src", f"{d}/train.tgt", itertools.chain(kept, original))
            if not n:  # nothing to train on (--min-kept 0); a small share is refused below, naming the way out
                raise TeacherError(f"nothing left of the distilled corpus after cleaning ({counts}); "
                                   f"look at {ddir}/distilled.txt")
            return {"removed": {k: v for k, v in counts.items() if k != "kept"}, "distilled_kept": counts["kept"],
                    "pairs": n, "mixed_original": cfg.mix_original}

        key, d, result = self.runner.stage("corpus", opts, [dkey], _no_work, finish)
        self.check_kept(result, f"{ddir}/distilled.txt")
        return key, d

    def check_kept(self, result: dict, distilled: str) -> None:
        """StageCollapsed when cleaning kept less than --min-kept of the teacher's translations and
        the student would train on them alone."""
        cfg = self.cfg
        n = sum(result["removed"].values()) + result["distilled_kept"]
        if cfg.mix_original or result["distilled_kept"] >= cfg.min_kept * n:
            return
        removed = ", ".join(f"{v:,} {k}" for k, v in result["removed"].items() if v)
        if self.teacher_bleu is not None:  # our own teacher: it had too little time
            why = (f"the teacher (dev BLEU {self.teacher_bleu:.2f}) did not learn to translate this corpus; "
                   f"give it a longer budget (--teacher-minutes, --teacher-steps)")
        else:
            why = f"the teacher did not translate this corpus (see {distilled}); try another teacher"
        raise StageCollapsed(
            f"cleaning kept {result['distilled_kept']:,} of the teacher's {n:,} translations (removed {removed}), "
            f"below --min-kept {cfg.min_kept:g}: {why}, or train the student on the original pairs too "
            f"(--mix-original); the stages done are kept for the rerun")

    def students(self, jobs: list[tuple]) -> dict[str, tuple[str, str]]:
        """Train and export each (name, train.src, train.tgt, upstream): {name: (key, model dir)}.
        Two to train on CPU, one rank, 2+ cores: side by side, each on its own cores (side.py)."""
        cfg = self.cfg
        stages = []
        for name, src, tgt, upstream in jobs:
            tc = train_config(cfg, "student", cfg.student_preset, src, tgt, self.device)
            # keyed by the mode: the teacher's dir is a path, its content is fixed by the upstream keys
            tc = dataclasses.replace(tc, init_from=self.init.get("from"))
            opts = train_stage_options(tc, init=self.init["mode"])
            stages.append((name, tc, upstream, opts, self.runner.dir_of(name, opts, upstream)))
        pending = [s for s in stages if not os.path.exists(f"{s[4]}/done.json")]
        shares, why = side.split_cores(cfg.side_by_side, len(pending), self.on_gpu, self.world,
                                       "LOCAL_RANK" in os.environ, os.sched_getaffinity(0)
                                       if hasattr(os, "sched_getaffinity") else {0})
        beside = {}
        if shares:
            t0 = time.time()
            runs = []
            for name, tc, _, _, d in pending:
                os.makedirs(d, exist_ok=True)
                runs.append((name, dataclasses.replace(tc, out_dir=f"{d}/train"), f"{d}/train.log"))
            beside = side.train_side_by_side(runs, shares, self.log)
            wall = round(time.time() - t0, 1)
            for name in beside:
                beside[name].update(beside=[n for n in beside if n != name], wall_seconds=wall)
        if self.rank == 0:
            self.runner.manifest["students"] = {"side_by_side": bool(shares), **({"reason": why} if why else {}),
                                                "cores": {n: b["cores"] for n, b in beside.items()}}
        return {name: self.student(name, tc, upstream, beside.get(name)) for name, tc, upstream, _, _ in stages}

    def student(self, name: str, tc: TrainConfig, upstream: list[str], beside: dict | None) -> tuple[str, str]:
        """Train (unless trained side by side: `beside`, what its process saw) and export a
        student: (key, model dir)."""
        def finish(d):
            export_checkpoint(f"{d}/train/best.pt", f"{d}/model")
            return _training_result(d, init=self.init["mode"], **({"side_by_side": beside} if beside else {}))

        key, d = self._train_stage(name, tc, upstream, finish, trained=beside is not None, init=self.init["mode"])
        self.runner.link(f"{name}-model", f"{d}/model")
        return key, f"{d}/model"

    def shortlist(self, stage: str, model_dir: str, train_src: str, train_tgt: str, upstream: list[str]):
        """The lexical shortlist of a student's training corpus, into its model dir."""
        opts = {"k": self.cfg.shortlist_k, "frequent": self.cfg.shortlist_frequent}

        def build(d):
            return add_to_model_dir(model_dir, train_src, train_tgt, k=opts["k"], n_frequent=opts["frequent"],
                                    verbose=self.verbose)

        self.runner.stage(stage, opts, upstream, _no_work, build)
        # the file lives in the student's model dir, which every shortlist key shares:
        # a reused stage may find another key's file there, so rebuild that one
        if self.rank == 0 and _shortlist_options(model_dir) != opts:
            self.log(f"[{stage}] {model_dir} holds another shortlist; rebuilding")
            build(None)
        barrier()

    def report(self, systems: list) -> dict | None:
        """Score every system on the test split; the report is copied to the run dir and returned (rank 0)."""
        cfg = self.cfg
        opts = {"test_limit": cfg.test_limit, "teacher_beam": cfg.teacher_beam, "student_beam": cfg.student_beam,
                "engine": cfg.engine, "precision": cfg.precision, "teacher": self.teacher.identity,
                "searches": "headline + greedy and teacher beam for our teacher and KD student"}

        def finish(d):
            return report_mod.evaluate(d, self.prep, systems, cfg, self.runner.manifest, self.log)

        upstream = [k for _, _, keys in systems for k in keys]
        _, d, _ = self.runner.stage("report", opts, upstream, _no_work, finish)
        result = None
        if self.rank == 0:
            for f in ("report.md", "report.json"):
                shutil.copyfile(f"{d}/{f}", os.path.join(self.runner.dir, f))
            if os.path.exists(f"{d}/{chart.CHART}"):  # dev-BLEU curves, where a system was trained here
                shutil.copyfile(f"{d}/{chart.CHART}", os.path.join(self.runner.dir, chart.CHART))
            with open(f"{d}/report.json", encoding="utf-8") as fh:
                result = json.load(fh)
        barrier()
        return result


def _decoding(teacher) -> dict:
    """How a model teacher decodes (its precision, the decoder's default for this CPU, and
    its worker processes), for the manifest."""
    if not hasattr(teacher, "workers"):
        return {"engine": teacher.engine}
    out = {"engine": teacher.engine, "precision": teacher.precision, "workers": teacher.workers}
    if teacher.precision == "int8":  # not the fp32 of earlier runs: say why
        out["precision_note"] = "int8: the decoder's default on a CPU with an int8 kernel"
    return out


def _no_work(d):
    """Stages whose work is all in finish (rank 0 alone)."""


def _shortlist_options(model_dir) -> dict | None:
    """{"k", "frequent"} the model dir's shortlist was built with (its safetensors metadata)."""
    try:
        cfg = modeldir.read_config(model_dir)
        with safe_open(os.path.join(model_dir, cfg.shortlist or modeldir.SHORTLIST), "pt") as fh:
            meta = fh.metadata() or {}
        return {"k": int(meta["k"]), "frequent": int(meta["frequent"])}
    except (OSError, KeyError, ValueError, SafetensorError, modeldir.ModelDirError):
        return None


def _digest(path):
    return file_digest(path) if os.path.isfile(path) else None
