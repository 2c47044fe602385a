"""Checkpoint averaging: the mean of the last N step checkpoints (a cheap ensemble)."""
from __future__ import annotations

import glob
import os

from student.export import CheckpointError, load_weights_only
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
