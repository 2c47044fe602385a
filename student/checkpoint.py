"""Reading student.train checkpoints: what export, averaging and resume load.

    ck = read_checkpoint("runs/x/best.pt")     # weights-only, its model_args within the schema
    model = model_of(ck, "runs/x/best.pt")     # the Transformer, its weights loaded
    path, ck, skipped = newest_checkpoint("runs/x", usable)   # what a resumed run starts from

A checkpoint is a pickle: torch.load runs with weights_only, so a planted file is
refused and never loaded otherwise. Its model arguments meet the bounds config.json
meets (student/modeldir.py checked_args) before any tensor is allocated: accepted,
vocab_size 2**40 asked for a 2 PB embedding. Every failure is one CheckpointError line
naming the file.
"""
from __future__ import annotations

import glob
import os
import pickle
import re
import warnings

import torch

from student.model import Transformer
from student.modeldir import checked_args

LAST = "last.pt"
STEP_NAME = re.compile(r"ckpt-(\d+)\.pt")


class CheckpointError(ValueError):
    """A file that is not a student.train checkpoint; str(e) is one line naming it."""


def load_weights_only(path: str):
    """torch.load of a file we wrote, refusing arbitrary pickles; CheckpointError names the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: {'is a directory, not a' if os.path.isdir(path) else 'no such'} checkpoint")
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol before refusing
            warnings.simplefilter("ignore", UserWarning)
            # our own checkpoints only; weights_only refuses arbitrary pickled code
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"{path}: refused: not a weights-only torch checkpoint "
                              f"(arbitrary pickles are never loaded)") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"{path}: not a torch checkpoint ({why})") from None
    return ckpt


def read_checkpoint(path: str) -> dict:
    """The checkpoint at `path`, with its model_args checked against the model dir's schema."""
    ckpt = load_weights_only(path)
    missing = [k for k in ("model_args", "model", "meta") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a student.train checkpoint (no {missing[0]!r})")
    try:
        checked_args(ckpt["model_args"], f"{path}: model_args")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(ckpt["model"], dict) or not isinstance(ckpt["meta"], dict):
        raise CheckpointError(f"{path}: not a student.train checkpoint ('model' and 'meta' must be tables)")
    return ckpt


def model_of(ckpt: dict, path: str) -> Transformer:
    """The Transformer of a checkpoint read_checkpoint accepted, its weights loaded."""
    model = Transformer(checked_args(ckpt["model_args"], path))
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, AttributeError) as e:  # missing, unexpected or misshapen tensors
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()[:200]
        raise CheckpointError(f"{path}: its weights do not fit its model_args ({why})") from None
    return model


def step_of(path: str) -> int | None:
    m = STEP_NAME.fullmatch(os.path.basename(path))
    return int(m.group(1)) if m else None


def newest_checkpoint(run_dir: str, usable) -> tuple[str | None, dict | None, list[str]]:
    """(path, checkpoint, why each one skipped was skipped) of the newest checkpoint in run_dir that
    loads and that usable(ckpt, path) accepts (it raises CheckpointError otherwise): last.pt or a
    step checkpoint ckpt-STEP.pt of a later step (an evaluation writes one without last.pt).
    (None, None, []) when there is none; (None, None, reasons) when none loads."""
    last = os.path.join(run_dir, LAST)
    steps = sorted((p for p in glob.glob(os.path.join(run_dir, "ckpt-*.pt")) if step_of(p) is not None),
                   key=step_of, reverse=True)
    found, skipped = (None, None), []
    for path in ([last] if os.path.lexists(last) else []) + steps:
        if found[1] is not None and path != last and step_of(path) <= found[1]["step"]:
            break  # no later step checkpoint than the last.pt that loaded
        try:
            ck = read_checkpoint(path)
            usable(ck, path)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        if found[1] is None or ck["step"] > found[1]["step"]:
            found = (path, ck)
        if path != last:
            break  # the newest step checkpoint that loads
    return found[0], found[1], skipped
