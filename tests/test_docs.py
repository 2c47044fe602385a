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


# the manual: how the kit works and how to use it; runs and their dates live on results pages
MANUAL = ("cli.md", "design.md", "data.md", "training.md", "distill.md", "container.md", "container-build.md",
          "evaluation.md", "reliability.md")
RESULTS = os.path.join("docs", "bench")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# words about how a machine was obtained or who ran what, not about the project
NOT_THE_PROJECTS = re.compile(rb"(?<![A-Za-z0-9_])(session|sessions|lent|lease|agent)(?![A-Za-z0-9_])", re.I)
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


def docs_pages() -> list[str]:
    """The tracked pages of docs/ outside docs/history/ (docs/README.md, the index, aside)."""
    return [f for f in committed_docs() if f.startswith("docs/") and f.endswith(".md")
            and not f.startswith("docs/history/") and f != "docs/README.md"]


def linked_from(page: str) -> set[str]:
    base = os.path.dirname(page)
    return {os.path.normpath(os.path.join(base, t.split("#")[0])) for t in LINK.findall(read(page))
            if not re.match(r"[a-z]+:|#", t)}


def table_cells(text: str) -> list[str]:
    return [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]


def test_docs_index_links_every_page_outside_history():
    pages = docs_pages()
    assert "docs/bench/README.md" in pages and "docs/cli.md" in pages
    assert sorted(set(pages) - linked_from("docs/README.md")) == []


def test_readme_is_short_with_short_cells_and_no_commit_hash():
    text = read("README.md")
    assert len(text.split()) <= 1200
    assert [c for c in table_cells(text) if len(c) > 250] == []
    assert HASH.findall(text) == []
    assert HASH.findall("code of e20381c, 5cd7a9e") and not HASH.findall("deadbeef 2026 1,234 avx512")


def test_readme_and_docs_speak_of_the_project_only():
    assert NOT_THE_PROJECTS.search(b"the GPU Session's time") and not NOT_THE_PROJECTS.search(b"gpu_session.sh lentil")
    found = []
    for d, dirs, names in os.walk(os.path.join(ROOT, "docs")):
        dirs[:] = [x for x in dirs if x != "history"]
        for n in names:
            with open(os.path.join(d, n), "rb") as fh:
                if NOT_THE_PROJECTS.search(fh.read()):
                    found.append(os.path.relpath(os.path.join(d, n), ROOT))
    with open(os.path.join(ROOT, "README.md"), "rb") as fh:
        found += ["README.md"] * bool(NOT_THE_PROJECTS.search(fh.read()))
    assert found == []


def test_results_folder_holds_at_most_20_files_at_its_top():
    assert len(os.listdir(os.path.join(ROOT, RESULTS))) <= 20


def test_manual_pages_carry_no_dated_runs():
    assert {f"docs/{m}" for m in MANUAL} <= set(committed_docs())
    dated = {m: DATE.findall(read(os.path.join("docs", m))) for m in MANUAL}
    assert {m: d for m, d in dated.items() if d} == {}, "move the run to its results page under docs/bench/"
