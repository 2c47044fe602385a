"""Run a local system (our decoder, CTranslate2, HF) in a child process and collect its
measurements; the child is submission/evaluate/worker.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .systems import System

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(system: System, ct2_isa: str | None) -> dict:
    env = dict(os.environ)
    if system.threads:
        # as /run.sh CPU-1 does: OpenMP/MKL size their pools when they load
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(system.threads)
    if ct2_isa:
        env["CT2_FORCE_CPU_ISA"] = ct2_isa  # same kernels in every CT2 row (tools/bench.py)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_local(system: System, lines: list[str], repeats: int, warmup_lines: int, max_tokens: int | None = None,
              ct2_isa: str | None = None, timeout: float | None = None) -> dict:
    """The worker's result: load_s, warmup, runs (seconds, per-line latencies), hyps,
    peak_rss_mb, model_bytes; or {"error": one line}."""
    with tempfile.TemporaryDirectory(prefix="evaluate-") as tmp:
        src = os.path.join(tmp, "src.txt")
        with open(src, "w", encoding="utf-8", newline="") as fh:
            fh.writelines(x + "\n" for x in lines)
        spec = {**system.config(), "lines": src, "repeats": repeats, "warmup_lines": warmup_lines,
                "max_tokens": max_tokens}
        spec_path, res_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(spec, fh)
        try:
            p = subprocess.run([sys.executable, "-m", "submission.evaluate.worker", spec_path, res_path],
                               cwd=ROOT, env=child_env(system, ct2_isa), capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s"}
        if os.path.isfile(res_path):
            with open(res_path, encoding="utf-8") as fh:
                return json.load(fh)
        tail = p.stderr.decode(errors="replace").strip().splitlines()
        return {"error": f"worker exited with status {p.returncode}: {tail[-1] if tail else 'no output'}"}
