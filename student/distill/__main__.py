"""python -m student.distill [--preset default|wmt] [--teacher-cmd CMD | --teacher-model DIR ... | --teacher-hf DIR]"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from decoder import cliargs, durable, fileerrors
from decoder.cliargs import MAX_BEAM, float_range, int_range, nonneg_float, nonneg_int, positive_float, positive_int
from decoder.machine import device_kind
from decoder.modeldir import MAX_VOCAB, ModelDirError, folder_name_error
from student.data import DataError
from student.distill.pipeline import AUTO_TEACHER, DEVICE_DEFAULTS, PRESETS, DistillConfig, run, teacher_choice
from student.train import sizing

SIZED = (f"the trainer's for the device: on CPU {sizing.REF_TOKENS} tokens, lr {sizing.REF_LR:g}, "
         f"{sizing.REF_WARMUP} warm-up steps; on CUDA sized by free GPU memory, python -m student.train --help")
from student.distill.side import StudentTrainingError
from student.distill.teachers import TeacherError


def parser() -> argparse.ArgumentParser:
    d = DistillConfig()
    p = cliargs.ArgumentParser(
        prog="python -m student.distill", formatter_class=cliargs.HelpFormatter,
        description="Sequence-level knowledge distillation, end to end: train (or plug in) a teacher, "
                    "translate the training source side in resumable shards, clean the result, train a "
                    "deep-encoder/shallow-decoder student on it, export it as a model dir, and write "
                    "runs/NAME/report.md (+ .json): BLEU/chrF on the test split, words/s, model sizes. "
                    "Rerunning the same command skips finished stages; changing an option reruns only the "
                    "stages that depend on it. Launch with torchrun to train with DDP and split the "
                    "shards across ranks.",
        epilog="Defaults shown are the 'default' preset's on CPU (2 cores, about 2 hours); on a GPU the "
               f"'default' preset changes {json.dumps(DEVICE_DEFAULTS['cuda'])} (target: 20 minutes on one "
               "H100), its teacher is "
               f"{AUTO_TEACHER['cuda'][0]} {json.dumps(AUTO_TEACHER['cuda'][1])}, and batches, lr and warm-up "
               f"are the trainer's GPU sizes; --preset wmt changes them: {json.dumps(PRESETS['wmt'])}",
        argument_default=None)
    cliargs.add_version(p)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS),
                   help="default: embedded Bible en-es on CPU; wmt: the GPU-scale recipe")
    p.add_argument("--name", help="run name: everything goes to RUNS_DIR/NAME (default: the preset's name)")
    p.add_argument("--runs-dir", help=f"(default {d.runs_dir})")
    p.add_argument("--force", action="store_true", default=None,
                   help="write into RUNS_DIR/NAME even if it is not a run of this command")
    for add in (_data_args, _teacher_args, _corpus_args, _student_args, _training_args):
        add(p, d)
    return p


def _data_args(p, d: DistillConfig):
    g = p.add_argument_group("data (default: the embedded Bible en-es)")
    g.add_argument("--corpus", help=f"embedded corpus name (default {d.corpus})")
    g.add_argument("--src", help="your own source file, one sentence per line (plain or .gz)")
    g.add_argument("--tgt", help="your own target file, same line count")
    g.add_argument("--src-lang", help="source language (default: the file suffix)")
    g.add_argument("--tgt-lang", help="target language (default: the file suffix)")
    for split in ("dev", "test"):
        g.add_argument(f"--{split}-src", help=f"your own {split} source file, e.g. a newstest "
                                              f"(default: the corpus' {split} split)")
        g.add_argument(f"--{split}-tgt", help="its reference translations, same line count")
    g.add_argument("--vocab-size", type=int_range(1, MAX_VOCAB),
                   help=f"joint SentencePiece vocabulary (default {d.vocab_size})")
    g.add_argument("--train-limit", type=nonneg_int, help="use only the first N training pairs (smoke runs)")
    g.add_argument("--test-limit", type=nonneg_int, help="score only the first N test pairs in the report")


def _teacher_args(p, d: DistillConfig):
    g = p.add_argument_group("teacher (default: train our own; give at most one of the next three)")
    g.add_argument("--teacher-cmd", help="external teacher: a shell command reading source lines on stdin and "
                                         "writing one translation per line, e.g. 'apertium -u eng-spa'")
    g.add_argument("--teacher-model", action="append", metavar="DIR",
                   help="a model dir to use as the teacher (skips teacher training); repeat for an ensemble "
                        "(log-probabilities averaged per step)")
    g.add_argument("--teacher-hf", metavar="DIR", help="a local Hugging Face MarianMTModel dir (needs transformers)")
    g.add_argument("--teacher-preset", help=f"model preset of our own teacher (default {d.teacher_preset}: "
                                            f"{AUTO_TEACHER['cpu'][0]} on CPU, {AUTO_TEACHER['cuda'][0]} "
                                            f"with {json.dumps(AUTO_TEACHER['cuda'][1])} on a GPU)")
    g.add_argument("--teacher-minutes", type=nonneg_float,
                   help=f"teacher training budget (default {d.teacher_minutes})")
    g.add_argument("--teacher-steps", type=nonneg_int, help="teacher step limit (0 = none)")
    g.add_argument("--teacher-set", action="append", metavar="KEY=VALUE", help="override a teacher model field")
    g.add_argument("--teacher-lr", type=positive_float, help=f"(default {SIZED})")
    g.add_argument("--teacher-warmup", type=positive_int, help=f"(default {SIZED})")
    g.add_argument("--average-last", type=positive_int,
                   help="the exported teacher is the best on dev of its final weights, averages of them with up "
                        f"to N-1 recent step checkpoints, and best.pt (default {d.average_last})")
    g.add_argument("--teacher-beam", type=int_range(1, MAX_BEAM), help=f"teacher beam size (default {d.teacher_beam})")
    g.add_argument("--engine", choices=["auto", "decoder", "reference"],
                   help="how our model dirs are decoded: the lean decoder, the reference ensemble search in "
                        "student/distill/beam.py, or auto (decoder for one model when available)")


def _corpus_args(p, d: DistillConfig):
    g = p.add_argument_group("distilled corpus")
    g.add_argument("--shard-size", type=positive_int, help=f"source lines per shard (default {d.shard_size})")
    g.add_argument("--min-ratio", type=nonneg_float,
                   help=f"lowest source/target word ratio kept (default {d.min_ratio})")
    g.add_argument("--max-ratio", type=positive_float,
                   help=f"highest source/target word ratio kept (default {d.max_ratio})")
    g.add_argument("--max-repeat", type=positive_int,
                   help=f"drop outputs repeating a word or n-gram more than N times in a row (default {d.max_repeat})")
    g.add_argument("--mix-original", action=argparse.BooleanOptionalAction, default=None,
                   help="train the student on the distilled pairs plus the original pairs")
    g.add_argument("--min-kept", type=float_range(0.0, 1.0),
                   help="stop when cleaning keeps less than this share of the teacher's translations, "
                        f"unless --mix-original (0 = never; default {d.min_kept:g})")
    g.add_argument("--min-teacher-bleu", type=float_range(0.0, 100.0),
                   help="stop when our own teacher's dev BLEU is below this: it did not learn "
                        f"(0 = never; default {d.min_teacher_bleu:g})")


def _student_args(p, d: DistillConfig):
    g = p.add_argument_group("students")
    g.add_argument("--student-preset", help=f"student-tiny, student-6-1, student-12-1 (default {d.student_preset})")
    g.add_argument("--student-minutes", type=nonneg_float,
                   help=f"student training budget (default {d.student_minutes})")
    g.add_argument("--student-steps", type=nonneg_int, help="student step limit (0 = none)")
    g.add_argument("--student-set", action="append", metavar="KEY=VALUE", help="override a student model field")
    g.add_argument("--student-lr", type=positive_float, help=f"(default {SIZED})")
    g.add_argument("--student-warmup", type=positive_int, help=f"(default {SIZED})")
    g.add_argument("--student-init", choices=["auto", "teacher", "random"],
                   help="start the students from the teacher's weights (embeddings, encoder, first decoder "
                        "layer; docs/distill.md) or from random ones; auto: the teacher's where the teacher is "
                        f"one model dir of ours whose shapes map onto the student's (default {d.student_init})")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16", "int8", "fp16"],
                   help=f"lean-decoder precision for the students in the report (default {d.precision})")
    g.add_argument("--student-beam", type=int_range(1, MAX_BEAM),
                   help=f"students' beam in the report; 1 = greedy (default {d.student_beam})")
    g.add_argument("--baseline-student", action=argparse.BooleanOptionalAction, default=None,
                   help="also train the same student on the original pairs, for comparison "
                        "(default: off; on in the wmt preset)")
    g.add_argument("--side-by-side", action=argparse.BooleanOptionalAction, default=None,
                   help="on CPU with one rank and 2+ cores, train the student and the baseline at the same time, "
                        "each process pinned to half the cores with as many torch threads (1.5-1.6x the work of "
                        "one after the other on 2 cores; same weights as one after the other at those thread "
                        f"counts; default: {'on' if d.side_by_side else 'off'})")

    g.add_argument("--shortlist-k", type=nonneg_int,
                   help="lexical shortlist of each student (python -m student.shortlist): target tokens per "
                        f"source token; 0 = no shortlist (default {d.shortlist_k})")
    g.add_argument("--shortlist-frequent", type=nonneg_int,
                   help=f"most frequent target tokens in every shortlist (default {d.shortlist_frequent})")


def _training_args(p, d: DistillConfig):
    g = p.add_argument_group("training (teacher and students)")
    cliargs.alias(g, "--max-tokens", g.add_argument(
        "--max-batch-tokens", dest="max_tokens", metavar="N", type=positive_int,
        help=f"padded tokens per batch (default {SIZED})"))
    g.add_argument("--eval-every", type=nonneg_int,
                   help=f"steps between dev evaluations/step checkpoints (default {d.eval_every})")
    g.add_argument("--save-every", type=nonneg_int,
                   help=f"steps between resume and step checkpoints (default {d.save_every})")
    g.add_argument("--dev-max", type=nonneg_int, help=f"dev sentences for BLEU, 0 = all (default {d.dev_max})")
    g.add_argument("--patience", type=nonneg_int, help="stop after N evaluations without dev BLEU gain (0 = off)")
    g.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], help=f"(default {d.amp})")
    g.add_argument("--seed", type=nonneg_int, help=f"(default {d.seed})")


def _kv(items, option: str) -> dict:
    out = {}
    for kv in items or []:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"{option} expects KEY=VALUE, got {kv!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def options(argv) -> DistillConfig:
    """The run's configuration, checked against what the run can do before any work (the
    presets and --teacher-set/--student-set make models the decoder loads, the ratios are
    in order, the teacher model dirs exist); a bad one is one `error:` line and exit 2
    (SystemExit), as argparse's own errors."""
    a = parser().parse_args(argv)
    opts = {k: v for k, v in vars(a).items() if v is not None and k not in ("preset", "force")}
    opts.setdefault("name", a.preset)
    try:
        for k in ("teacher_set", "student_set"):
            if k in opts:
                opts[k] = _kv(opts[k], "--" + k.replace("_", "-"))
        cfg = DistillConfig.from_preset(a.preset, **opts)
        check(cfg)
        if not a.force and (why := foreign_run_dir(os.path.join(cfg.runs_dir, cfg.name))):
            raise ValueError(why)
    except (ValueError, ModelDirError) as e:
        cliargs.refuse(e)
    return cfg


def foreign_run_dir(run_dir: str) -> str | None:
    """Why the pipeline may not write into `run_dir` (a dir holding files, none of them a
    run's manifest: not a run of this command), or None."""
    if not os.path.isdir(run_dir) or os.path.isfile(os.path.join(run_dir, "manifest.json")):
        return None
    if not [n for n in os.listdir(run_dir) if n != durable.LOCK]:  # a lock: a run killed at its start
        return None
    return f"{run_dir}: exists and is not a student.distill run (no manifest.json); --force writes into it"


def check(cfg: DistillConfig) -> None:
    """ValueError for a configuration that would fail after hours of work (a student preset
    that does not exist fails only once the teacher is trained)."""
    from student.model import PRESETS as MODELS
    from student.train.__main__ import check_model
    if cfg.student_preset not in MODELS:
        raise ValueError(f"--student-preset {cfg.student_preset!r}: choose from {', '.join(sorted(MODELS))}")
    if cfg.teacher_preset != "auto" and cfg.teacher_preset not in MODELS:
        raise ValueError(f"--teacher-preset {cfg.teacher_preset!r}: choose from auto, {', '.join(sorted(MODELS))}")
    check_model(cfg.student_preset, {"vocab_size": cfg.vocab_size, **cfg.student_set}, "--student-set")
    own_teacher = not (cfg.teacher_cmd or cfg.teacher_hf or cfg.teacher_model)
    if own_teacher:  # the model the pipeline trains: `auto` is the device kind's entry (teacher_choice)
        name, sets = teacher_choice(cfg.teacher_preset, cfg.teacher_set, device_kind())
        check_model(name, {"vocab_size": cfg.vocab_size, **sets}, "--teacher-set")
    if cfg.min_ratio > cfg.max_ratio:
        raise ValueError(f"--min-ratio {cfg.min_ratio} is above --max-ratio {cfg.max_ratio}: no pair would be kept")
    for d in cfg.teacher_model:  # the full check (weights) comes with the teacher
        if why := cliargs.model_dir_error("--teacher-model", d, shortlist=False):
            raise ValueError(why)
    for x in ("", "dev_", "test_"):  # each given pair's files, before the run dir is made (half a pair: run's error)
        pair = {f"--{x.replace('_', '-')}{side}": getattr(cfg, x + side) for side in ("src", "tgt")}
        for flag, path in pair.items():
            if all(pair.values()) and (why := cliargs.file_error(flag, path)):
                raise ValueError(why)
    if cfg.teacher_hf and not os.path.isdir(cfg.teacher_hf):
        raise ValueError(f"--teacher-hf {cfg.teacher_hf}: Hugging Face model dir does not exist")
    if cfg.teacher_cmd is not None and not cfg.teacher_cmd.strip():  # "" would train a teacher instead
        raise ValueError("--teacher-cmd: an empty command")
    if folder_name_error(cfg.name):
        raise ValueError(f"--name {cfg.name[:40]!r}: a folder name under --runs-dir, without '/' "
                         f"(letters, digits, '.', '-', '_', at most 100 characters, not starting with '.')")
    if why := cliargs.out_dir_error("--runs-dir", cfg.runs_dir):
        raise ValueError(why)


@fileerrors.one_line
def main(argv=None) -> int:
    try:
        cfg = options(argv)
    except cliargs.Refused:
        return 2
    try:
        with run_lock(cfg):
            rep = run(cfg)
    except (TeacherError, DataError, ModelDirError, ValueError, FileNotFoundError, StudentTrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rep is not None:  # rank 0
        with open(os.path.join(cfg.runs_dir, cfg.name, "report.md"), encoding="utf-8") as fh:
            print(fh.read(), end="")
    return 0


def run_lock(cfg: DistillConfig):
    """runs/<name> held by this run while it writes (rank 0 of a torchrun holds it for all)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    return _locked_and_clean(os.path.join(cfg.runs_dir, cfg.name))


@contextlib.contextmanager
def _locked_and_clean(run_dir: str):
    """The run dir held, and the temp files a killed run left in it and its stage dirs gone."""
    with durable.locked(run_dir, "run dir"):
        for d in [run_dir] + [e.path for e in os.scandir(run_dir) if e.is_dir(follow_symlinks=False)]:
            for f in durable.remove_stale(d):
                print(f"removed {os.path.join(d, f)}: left by a run that was killed", file=sys.stderr)
        yield


def cli() -> int:
    """`python -m student.distill` and the `wmt-kit-distill` console script."""
    return cliargs.run(main)  # `| head` on the report ends quietly


if __name__ == "__main__":
    sys.exit(cli())
