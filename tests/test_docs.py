"""The committed docs are readable on any machine: no machine paths, no dead links.

A machine path is an absolute path outside the repository (/work/..., /root/...,
/tmp/..., /home/...): it names one machine's files, so a reader elsewhere cannot
follow it. Paths that are part of an interface every machine has are allowed,
listed in ALLOWED: the container's contract (/run.sh, /model), kernel files
(/dev/..., /proc/...) and system tools named as such (/usr/bin/time)."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALLOWED = ("/run.sh", "/model", "/dev/", "/proc", "/usr/bin/time", "/usr/share/sword", "/usr/local/cuda")
# an absolute path where a path can start: line start, blank, quote, bracket, =, : or ,
# (not the middle of a word or a URL: "words/s", "https://...")
ABSOLUTE = re.compile(r"(?:^|(?<=[\s`'\"(\[=:,]))/[A-Za-z0-9._~-]+(?:/[A-Za-z0-9._~+-]*)*", re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def committed_docs() -> list[str]:
    """Every tracked *.md, and every text file under docs/ (JSON, tables, profiles)."""
    r = subprocess.run(["git", "-C", ROOT, "ls-files", "*.md", "docs"], capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        files = r.stdout.split()
    else:  # not a git checkout (an unpacked sdist): the same selection from the tree
        files = []
        for d, dirs, names in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("runs", "build", "data", "__pycache__")]
            rel = os.path.relpath(d, ROOT)
            files += [os.path.normpath(os.path.join(rel, n)) for n in names
                      if n.endswith(".md") or rel.split(os.sep)[0] == "docs"]
    return sorted(f for f in files if f.endswith((".md", ".json", ".txt", ".csv")))


def machine_paths(text: str) -> list[str]:
    return [p for p in ABSOLUTE.findall(text)
            if not any(p == a or p.startswith(a.rstrip("/") + "/") for a in ALLOWED)]


def test_machine_path_finder_finds_absolute_paths_outside_the_interface():
    text = ('--model /work/x/student-model\n"input": "/tmp/a/test.en"\n`/root/.cache/y`\n(/home/u/z)\n'
            "OUT=/scratch/run words/s https://github.com/a/b 1/2 </s> docker run -v m:/model kit /run.sh\n"
            "cat /proc/PID/status > /dev/null; /usr/bin/time make; runs/default/student-model")
    assert machine_paths(text) == ["/work/x/student-model", "/tmp/a/test.en", "/root/.cache/y", "/home/u/z",
                                   "/scratch/run"]


def test_committed_docs_hold_no_machine_paths():
    docs = committed_docs()
    assert "README.md" in docs and "decoder/README.md" in docs and "docs/bench/summary.json" in docs
    found = {}
    for f in docs:
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            if hits := machine_paths(fh.read()):
                found[f] = hits[:3]
    assert not found, f"machine paths (use repository-relative paths or placeholders): {found}"


def test_relative_links_in_docs_lead_to_files():
    dead = []
    for f in committed_docs():
        if not f.endswith(".md"):
            continue
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            text = fh.read()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:|#", target):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(f), target.split("#")[0]))
            if not os.path.exists(path):
                dead.append(f"{f}: {target}")
    assert not dead, dead
