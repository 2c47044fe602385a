"""Checkpoint averaging (the mean of step checkpoints: a cheap ensemble), and the choice of
what to export among the final weights and averages of the recent step checkpoints."""
from __future__ import annotations

import glob
import os
import re

import torch

from student.checkpoint import CheckpointError, load_weights_only, model_of, read_checkpoint
from student.train.evaluate import score, translate_lean
from student.train.trainer import atomic_save


def last_checkpoints(run_dir: str, n: int) -> list[str]:
    cks = sorted(glob.glob(os.path.join(run_dir, "ckpt-*.pt")))
    if not cks:
        raise FileNotFoundError(f"{run_dir}: no ckpt-*.pt step checkpoints to average")
    return cks[-n:]


def _weights(path: str) -> dict:
    ck = load_weights_only(path)
    if not isinstance(ck, dict) or not isinstance(ck.get("model"), dict):
        raise CheckpointError(f"{path}: not a student.train checkpoint (no 'model')")
    return ck


def average(paths: list[str], out: str) -> str:
    """Writes a checkpoint whose weights are the mean of `paths` (same architecture).
    Raises CheckpointError (a ValueError) naming a file that is no checkpoint."""
    base = _weights(paths[0])
    acc = {k: v.double().clone() for k, v in base["model"].items()}
    for p in paths[1:]:
        sd = _weights(p)["model"]
        if sd.keys() != acc.keys() or any(v.shape != acc[k].shape for k, v in sd.items()):
            raise ValueError(f"{p}: parameters differ from {paths[0]}")
        for k, v in sd.items():
            acc[k] += v.double()
    base["model"] = {k: (v / len(paths)).to(base["model"][k].dtype) for k, v in acc.items()}
    base["averaged_from"] = [os.path.basename(p) for p in paths]
    for k in ("optimizer", "scaler"):  # an average has no optimiser state to resume from
        base[k] = None
    atomic_save(base, out)
    return out


def _step(path: str) -> int:
    m = re.fullmatch(r"ckpt-(\d+)\.pt", os.path.basename(path))
    if m:
        return int(m.group(1))
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])


def candidates(run_dir: str, most: int) -> list[dict]:
    """What a finished run could export, each {"name", "paths", "steps"}: the final weights
    (last.pt), the final weights averaged with the step checkpoints just before them
    (k = 2, 4, 8, ... and `most` members, as far as the checkpoints go), and best.pt
    when it is not the final step. Every average ends at the final step, so no step
    after the last checkpoint or evaluation is dropped."""
    last = os.path.join(run_dir, "last.pt")
    final = _step(last)
    earlier = [p for p in sorted(glob.glob(os.path.join(run_dir, "ckpt-*.pt"))) if _step(p) < final]
    out = [{"name": "last", "paths": [last], "steps": [final]}]
    sizes = sorted({min(k, len(earlier) + 1) for k in [*(2 ** i for i in range(1, 8) if 2 ** i <= most), most]})
    for k in (k for k in sizes if k >= 2):
        paths = earlier[len(earlier) - (k - 1):] + [last]
        out.append({"name": f"avg-{k}", "paths": paths, "steps": [_step(p) for p in paths]})
    best = os.path.join(run_dir, "best.pt")
    if os.path.exists(best) and _step(best) != final:
        out.append({"name": "best", "paths": [best], "steps": [_step(best)]})
    return out


def materialise(cand: dict, work_dir: str) -> str:
    """The candidate as one checkpoint file: its own, or its average written into work_dir."""
    if len(cand["paths"]) == 1:
        return cand["paths"][0]
    return average(cand["paths"], os.path.join(work_dir, f"{cand['name']}.pt"))


def dev_bleu(checkpoint: str, src: list[str], ref: list[str], work_dir: str) -> float:
    """The checkpoint's dev BLEU, decoded as the trainer's dev evaluations are (greedy, lean decoder)."""
    ck = read_checkpoint(checkpoint)
    model = model_of(ck, checkpoint)
    return score(translate_lean(model.eval(), ck["meta"], src, work_dir), ref)["bleu"]


def choose(cands: list[dict], scorer) -> tuple[dict, list[dict]]:
    """(the candidate with the highest scorer(candidate), every candidate with its "dev_bleu");
    a tie goes to the earlier candidate (the final weights come first)."""
    scored = [{**c, "dev_bleu": scorer(c)} for c in cands]
    i = max(range(len(scored)), key=lambda i: (scored[i]["dev_bleu"], -i))
    return scored[i], scored
