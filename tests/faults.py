"""Fault injection for the writers: the k-th write, fsync, rename or file creation of a
command, under its output's dir, fails with a chosen errno (tests/faultshim.c, preloaded).

    runs = run_cases(shim, under, [
        {"argv": ["student.export", ckpt, out]},                      # counts the events
        {"argv": [...same...], "kind": "rename", "k": "last", "errno": errno.EACCES},
    ], env)

Every case of one list runs in one interpreter, one after the other, as `python -m` runs
the command (torch is imported once, not once a case); a case's "k" may be an int, or
"first", "mid", "last": of the events of its kind that the case before it (the count)
saw. Each result has the exit code, stderr, the events seen and injected, and the tree
under `under` just before and just after the case (relative names -> a digest), so a
test can ask: one error line, a non-zero status, nothing partial left, nothing lost.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("write", "fsync", "rename", "create")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faultshim.c")


def build_shim(out_dir: str) -> str | None:
    """The preload library, compiled with the system's C compiler (None: there is none)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    so = os.path.join(out_dir, "faultshim.so")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", so, SOURCE, "-ldl"], check=True, capture_output=True)
    return so


def tree(root: str) -> dict:
    """Every name under root -> what it is (a file's sha256, a link's target, "dir")."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return out


def _pick(k, seen: int) -> int:
    if isinstance(k, int):
        return k
    return {"first": 1, "mid": max(1, (seen + 1) // 2), "last": max(1, seen)}[k]


def _driver(under: str, state: str, cases: list) -> list:
    import contextlib
    import io
    import runpy
    import traceback
    import warnings
    warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
    results, counts = [], [0, 0, 0, 0]
    for case in cases:
        kind = KINDS.index(case["kind"]) if case.get("kind") else -1
        k = _pick(case.get("k", 1), counts[kind]) if kind >= 0 else 0
        with open(state, "r+b") as fh:
            fh.write(struct.pack("8q", 0, 0, 0, 0, kind, k, case.get("errno", errno.ENOSPC), 0))
        before = tree(under)
        sys.argv, err, code = ["-m"] + case["argv"][1:], io.StringIO(), "no exit"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                runpy.run_module(case["argv"][0], run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = e.code
            except BaseException:
                code = "traceback"
                traceback.print_exc()
        with open(state, "rb") as fh:
            seen = struct.unpack("8q", fh.read(64))
        if kind < 0:
            counts = list(seen[:4])
        results.append({"case": case, "k": k, "code": code, "stderr": err.getvalue(), "seen": seen[:4],
                        "injected": seen[7], "before": before, "after": tree(under)})
    return results


def run_cases(shim: str, under: str, cases: list, env: dict | None = None, timeout: int = 600) -> list:
    """Run the cases (above) in one interpreter with the shim preloaded; their results."""
    state = os.path.join(os.path.dirname(shim), f"state-{os.getpid()}-{abs(hash(under))}")
    with open(state, "wb") as fh:
        fh.write(bytes(64))
    e = {**(env or os.environ), "LD_PRELOAD": shim, "FAULT_UNDER": os.path.abspath(under), "FAULT_STATE": state,
         "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    r = subprocess.run([sys.executable, os.path.abspath(__file__), os.path.abspath(under), state, json.dumps(cases)],
                       capture_output=True, text=True, env=e, cwd=ROOT, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.splitlines()[-1])


def error_lines(stderr: str) -> list[str]:
    """The error lines of stderr (one may follow a progress bar that was cut short)."""
    return [x for x in stderr.splitlines() if re.search(r"(^|\]|\r)error: ", x)]


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    out = _driver(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    sys.stdout = sys.__stdout__
    print(json.dumps(out))
