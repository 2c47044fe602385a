"""Stages of a run, keyed by what they depend on, and the run's manifest.

A stage's key is the hash of its options and its upstream stages' keys; its
output lives in runs/<name>/<stage>-<key>/ and counts as finished once
done.json is there. So rerunning a command skips finished stages, a changed
option gives new keys to exactly the stages downstream of it, and an
interrupted stage resumes inside its own dir (trainer checkpoints, shards).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import time

import torch.distributed as dist

from decoder import cliargs, durable

PACKAGES = ("torch", "sentencepiece", "sacrebleu", "sacremoses", "numpy", "safetensors", "transformers",
            "ctranslate2")


def stage_key(name: str, options: dict, upstream: list[str]) -> str:
    blob = json.dumps({"stage": name, "options": options, "upstream": upstream}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def write_json(path: str, obj) -> None:
    durable.write_json(path, obj, default=str)


def barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def versions() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    out["kit"] = cliargs.version()
    # only the kit's own checkout: the repository enclosing the working dir may be anyone's
    if commit := cliargs.checkout_commit():
        out["git"] = commit
    return out


class Run:
    """runs/<name>/: manifest.json plus one dir per (stage, key)."""

    def __init__(self, run_dir: str, config: dict, rank: int = 0, log=print):
        self.dir, self.rank, self.log = os.path.abspath(run_dir), rank, log
        self.manifest_path = os.path.join(self.dir, "manifest.json")
        os.makedirs(self.dir, exist_ok=True)
        self.manifest = {"config": config, "versions": versions(), "inputs": {}, "stages": {},
                         "invocation": {"argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")}}
        if os.path.exists(self.manifest_path):
            with open(self.manifest_path, encoding="utf-8") as fh:
                old = json.load(fh)
            # stages from earlier invocations stay listed (their dirs are still there)
            self.manifest["previous_stages"] = {**old.get("previous_stages", {}), **old.get("stages", {})}
        self.save()

    def save(self):
        if self.rank == 0:
            write_json(self.manifest_path, self.manifest)

    def dir_of(self, name: str, options: dict, upstream: list[str]) -> str:
        """Where stage(name, options, upstream) runs (finished once done.json is there)."""
        return os.path.join(self.dir, f"{name}-{stage_key(name, options, upstream)}")

    def stage(self, name: str, options: dict, upstream: list[str], work, finish=None):
        """Run (or reuse) a stage; returns (key, dir, result).

        work(dir) runs on every rank (training and distillation are collective);
        finish(dir) runs on rank 0 after all ranks are through and returns the
        stage's JSON result, written to done.json.
        """
        key = stage_key(name, options, upstream)
        d = self.dir_of(name, options, upstream)
        done = os.path.join(d, "done.json")
        barrier()
        entry = {"key": key, "dir": d, "options": options, "upstream": upstream}
        if os.path.exists(done):
            self.log(f"[{name}] up to date ({_show(d)})")
            entry["status"] = "reused"
        else:
            self.log(f"[{name}] running in {_show(d)}")
            os.makedirs(d, exist_ok=True)
            t0 = time.time()
            result = work(d)
            barrier()
            if self.rank == 0:
                if finish is not None:
                    result = finish(d)
                durable.fsync_tree(d)  # done.json vouches for the outputs: they reach the disk first
                write_json(done, {"key": key, "result": result, "seconds": round(time.time() - t0, 1),
                                  "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
            barrier()
            entry["status"] = "ran"
        with open(done, encoding="utf-8") as fh:
            info = json.load(fh)
        entry.update(seconds=info["seconds"], finished=info["finished"], result=info["result"])
        self.manifest["stages"][name] = entry
        self.save()
        return key, d, info["result"]

    def link(self, name: str, target: str):
        """runs/<name>/<name> -> the current stage output, for people and scripts."""
        if self.rank != 0:
            return
        path = os.path.join(self.dir, name)
        durable.write_link(path, os.path.relpath(target, self.dir))


def _show(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
