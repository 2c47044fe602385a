"""The layout: the runtime (decoder/), the container payload (submission/container/),
the tools (tools/) and the host-side harness (submission/image.py, evaluate/)
each in a place of its own; the image is built from the first two only."""
import ast
import os
import sys
from fnmatch import fnmatch

from submission.image import DOCKER, image_paths, sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def py_files(top: str) -> set[str]:
    out = set()
    for d, dirs, names in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out |= {os.path.relpath(os.path.join(d, n), ROOT) for n in names if n.endswith(".py")}
    return out


def project_imports(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.split(".")[0] in ("decoder", "student", "submission", "tools")}


def test_image_sources_are_the_runtime_and_the_payload_only():
    in_image = {f for f in sources() if f.endswith(".py")}
    assert in_image == py_files("decoder") | py_files("submission/container") | {"submission/__init__.py"}
    assert "decoder/csrc/fused_cpu.cpp" in sources()


def test_image_is_built_from_the_one_list_in_dockerignore():
    dockerfile = open(os.path.join(DOCKER, "Dockerfile")).read()
    copied = {src for ln in dockerfile.splitlines() if ln.startswith("COPY ") and "--from" not in ln
              for src in ln.split()[1:-1]}
    listed = image_paths()
    # a wildcard source names a listed path too (the Dockerfile's check of the staged build/image)
    assert copied and all(any(fnmatch(p, c) or c.startswith(p + "/") for p in listed) for c in copied), copied


def test_runtime_and_payload_import_nothing_outside_the_image():
    for f in py_files("decoder") | py_files("submission/container"):
        outside = {m for m in project_imports(f) if not m.startswith(("decoder", "submission.container"))}
        assert not outside, f"{f} imports {outside}"


def test_decoder_never_imports_student_or_tools():
    for f in py_files("decoder"):
        up = {m for m in project_imports(f) if m.split(".")[0] in ("student", "tools")}
        assert not up, f"{f} imports {up}"
    for f in py_files("tools"):
        assert not {m for m in project_imports(f) if m.split(".")[0] == "student"}, f


def module_of(path: str) -> str:
    """student/train/__init__.py -> student.train; student/export.py -> student.export."""
    parts = path[:-len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: str, known: set[str]) -> set[str]:
    """The project modules a file imports, at any depth (function-level imports
    count: a lazy import hides a circle, it does not remove it). `from pkg import
    name` is an edge to pkg.name when that is a module, else to pkg."""
    here = module_of(path)
    package = here if path.endswith("__init__.py") else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            mod = node.module if not node.level else ".".join(x for x in (base, node.module) if x)
            subs = {f"{mod}.{a.name}" for a in node.names} & known
            out |= subs or {mod}
    return out & known


def import_circle(top: str) -> list[str] | None:
    """One import circle among the modules under top, as [a, b, ..., a], or None."""
    files = {module_of(f): f for f in py_files(top)}
    graph = {m: imported_modules(f, set(files)) - {m} for m, f in files.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [m, n] if n in path else [m, n]
            if n not in state and (found := visit(n, path + [m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def test_student_has_no_import_circle():
    assert import_circle("student") is None, " -> ".join(import_circle("student"))


def test_import_circle_finder_sees_a_function_level_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a  # lazy, still a circle\n")
    (pkg / "c.py").write_text("from . import b\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert import_circle("pkg") in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])
    (pkg / "b.py").write_text("def f():\n    pass\n")
    assert import_circle("pkg") is None
