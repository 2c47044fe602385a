"""The layout: the runtime (decoder/), the container payload (submission/container/),
the tools (tools/) and the host-side harness (submission/image.py, evaluate/)
each in a place of its own; the image is built from the first two only."""
import ast
import os
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
    for f in py_files("decoder") | py_files("tools"):
        assert not {m for m in project_imports(f) if m.startswith("student")}, f
