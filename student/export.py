"""Checkpoint -> model dir (decoder/modeldir.py is the contract).

    python -m student.export runs/x/teacher/best.pt runs/x/teacher/model

Loads the checkpoint, records where it came from (`provenance`) and writes the
model dir with student/modeldir.py (atomically: a half-written model dir never
exists under OUT_DIR).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from decoder import durable, fileerrors, modeldir
from decoder.cliargs import ArgumentParser, add_version
from student.checkpoint import CheckpointError, model_of, read_checkpoint
from student.modeldir import write_model_dir
from student.train.trainer import TrainConfig


def export_checkpoint(ckpt_path: str, out_dir: str, force: bool = False) -> str:
    """The model dir of a checkpoint, written at out_dir. An out_dir that holds more than a
    model dir's files (a run dir given by mistake) is refused unless `force`; one holding
    the checkpoint, always."""
    check_out_dir(ckpt_path, out_dir, force)
    durable.remove_stale_beside(out_dir)  # the temp dirs of an export that was killed
    ckpt = read_checkpoint(ckpt_path)
    model = model_of(ckpt, ckpt_path)
    meta = ckpt["meta"]
    return write_model_dir(model, meta["spm_model"], out_dir, meta, provenance(ckpt_path, ckpt))


def check_out_dir(ckpt_path: str, out_dir: str, force: bool) -> None:
    out = os.path.realpath(out_dir)
    if os.path.realpath(ckpt_path).startswith(out.rstrip(os.sep) + os.sep):
        raise fileerrors.Refused(f"{out_dir}: holds the checkpoint {ckpt_path}; write the model dir elsewhere")
    why = modeldir.replace_error(out_dir)
    if why and not force:
        raise fileerrors.Refused(f"{out_dir}: {why} (--force replaces it)")


# TrainConfig fields naming files: recorded relative to the run dir, never as host paths
PATH_FIELDS = ("src", "tgt", "train_src", "train_tgt", "dev_src", "dev_tgt", "test_src", "test_tgt")


def provenance(ckpt_path: str, ckpt: dict) -> dict:
    """What a model dir came from: the checkpoint relative to its run dir (the dir
    holding it), the preset, every --set override and every training option that
    differs from student.train's defaults, with file paths relative to the run dir."""
    run_dir = os.path.dirname(os.path.abspath(ckpt_path))
    cfg = ckpt.get("config") or {}
    defaults = json.loads(json.dumps(dataclasses.asdict(TrainConfig(out_dir="")), default=list))
    options = {k: v for k, v in cfg.items()
               if k not in ("out_dir", "preset", "model_overrides") and v != defaults.get(k)}
    cwd = _training_cwd(run_dir, cfg.get("out_dir") or "")
    for k in PATH_FIELDS:
        if options.get(k):
            p = options[k] if os.path.isabs(options[k]) or cwd is None else os.path.join(cwd, options[k])
            options[k] = os.path.relpath(p, run_dir) if os.path.isabs(p) else p
    out = {"checkpoint": os.path.basename(ckpt_path), "step": ckpt.get("step"),
           "preset": ckpt["meta"].get("preset"), "set": cfg.get("model_overrides", {}),
           "options": options, "torch": torch.__version__, "dev_bleu": ckpt.get("best_bleu")}
    if ckpt.get("averaged_from"):
        out["averaged_from"] = ckpt["averaged_from"]
    return out


def _training_cwd(run_dir: str, out_dir: str) -> str | None:
    """The dir training ran in, from its --out as given and where the run dir is now
    (None when they do not match: the run dir was moved)."""
    if not out_dir or os.path.isabs(out_dir):
        return None
    tail = os.path.normpath(out_dir)
    if tail == ".":
        return run_dir
    if run_dir.endswith(os.sep + tail):
        return run_dir[:-len(tail) - 1]
    return None


@fileerrors.one_line
def main(argv=None):
    p = ArgumentParser(prog="python -m student.export",
                       description="Write a model dir (config.json, model.safetensors, "
                                            "spm.model) from a student.train checkpoint.")
    add_version(p)
    p.add_argument("checkpoint", help="checkpoint written by student.train (best.pt / last.pt)")
    p.add_argument("out_dir", help="model dir to create (a model dir there is replaced atomically; "
                                   "a dir holding other files is refused)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR even if it holds other files")
    a = p.parse_args(argv)
    try:
        out = export_checkpoint(a.checkpoint, a.out_dir, a.force)
    except (CheckpointError, FileNotFoundError, KeyError, modeldir.ModelDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
