"""docs/design.md names every module of the kit, one line each at least, and nothing that is gone:
a module added without a line there, or renamed without its line, fails here."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPS = ("decoder", "student", "submission", "tools")
# a module as design.md names it: a repository path in backticks
NAMED = re.compile(r"`((?:%s)/[\w./-]+\.(?:py|sh))`" % "|".join(TOPS))


def modules(root: str) -> set[str]:
    """Every program file of the four parts: *.py (package __init__ files aside: the package's line
    speaks for them) and *.sh, outside build outputs and the C++ sources."""
    out = set()
    for top in TOPS:
        for d, dirs, names in os.walk(os.path.join(root, top)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "build", "csrc") and not x.startswith(".")]
            out |= {os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/") for n in names
                    if n.endswith((".py", ".sh")) and n != "__init__.py"}
    return out


def unnamed(mods: set[str], text: str) -> list[str]:
    return sorted(mods - set(NAMED.findall(text)))


def gone(text: str, root: str) -> list[str]:
    return sorted(p for p in set(NAMED.findall(text)) if not os.path.isfile(os.path.join(root, p)))


def test_the_checks_see_a_missing_line_and_a_line_for_a_gone_module(tmp_path):
    (tmp_path / "tools").mkdir()
    for n in ("__init__.py", "a.py", "b.py", "run.sh"):
        (tmp_path / "tools" / n).write_text("")
    mods = modules(str(tmp_path))
    assert mods == {"tools/a.py", "tools/b.py", "tools/run.sh"}
    text = "- `tools/a.py`: one line.\n- `tools/run.sh`: another.\n- `tools/old.py`: renamed since.\n"
    assert unnamed(mods, text) == ["tools/b.py"]
    assert gone(text, str(tmp_path)) == ["tools/old.py"]


def test_design_doc_names_every_module_and_no_gone_one():
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as fh:
        text = fh.read()
    mods = modules(ROOT)
    assert {"decoder/translator.py", "student/train/trainer.py", "submission/container/serve.py",
            "tools/bench.py"} <= mods
    assert unnamed(mods, text) == [], "add a line for each to docs/design.md"
    assert gone(text, ROOT) == [], "docs/design.md names modules that are not there"
