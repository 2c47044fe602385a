"""The run manifest names the kit's own code: its version always, a git commit only
when the kit's files are the top level of a git checkout (never the commit of some
other repository the kit was unpacked into)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="no git on this machine")


def git(cwd, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout.strip()


def copy_kit(dest) -> str:
    for d in ("decoder", "student", "submission"):
        shutil.copytree(os.path.join(ROOT, d), os.path.join(dest, d),
                        ignore=shutil.ignore_patterns("__pycache__", "build", "*.so"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), dest)
    return str(dest)


def manifest_versions(kit: str, cwd: str) -> dict:
    code = ("import json, student.distill.stages as s, submission.image as i; "
            "print(json.dumps({**s.versions(), 'file': s.__file__, 'label': i.git_revision()}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=dict(os.environ, PYTHONPATH=kit),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.pop("file").startswith(kit)  # the copy ran, not this checkout
    return out


def test_kit_inside_a_foreign_repository_records_its_version_and_no_commit(tmp_path):
    foreign = tmp_path / "someone-elses-repo"
    foreign.mkdir()
    git(foreign, "init", "-q")
    (foreign / "README").write_text("not the kit\n")
    git(foreign, "add", "README")
    git(foreign, "commit", "-qm", "theirs")
    kit = copy_kit(foreign / "vendor" / "kit")
    v = manifest_versions(kit, str(foreign))
    assert v["kit"].startswith("wmt-efficiency-kit ") and v["kit"] != "wmt-efficiency-kit unknown"
    assert "git" not in v, v  # the foreign repository's HEAD would name the wrong code
    assert v["label"] == "unknown"


def test_kit_in_its_own_checkout_records_that_commit(tmp_path):
    kit = copy_kit(tmp_path / "kit")
    git(kit, "init", "-q")
    git(kit, "add", "-A")
    git(kit, "commit", "-qm", "the kit")
    head = git(kit, "rev-parse", "HEAD")
    v = manifest_versions(kit, str(tmp_path))
    assert v["git"] == head and v["label"] == head
    with open(os.path.join(kit, "pyproject.toml"), "a") as fh:
        fh.write("\n")
    assert manifest_versions(kit, str(tmp_path))["git"] == head + "+dirty"
