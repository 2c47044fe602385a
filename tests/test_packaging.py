"""`pip install .` into a fresh virtualenv outside the repo: the package decodes with
the fused C++ ops from any directory, its console scripts are the `python -m`
commands, and every command says its version."""
import glob
import json
import os
import shutil
import site
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest

from conftest import python_m_each
from decoder import cliargs
from submission.image import sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")
SRC = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "test.en")
LINES = 24  # several batches of 8, a few seconds of decoding
VERSION = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["version"]
# each console script and the `python -m` command whose function it is
SCRIPTS = {"wmt-kit-translate": "decoder.__main__:cli", "wmt-kit-convert": "tools.convert.__main__:cli",
           "wmt-kit-distill": "student.distill.__main__:cli", "wmt-kit-train": "student.train.__main__:main",
           "wmt-kit-evaluate": "submission.evaluate.__main__:cli", "wmt-kit-bench": "tools.bench:main"}
# what a checkout has at its top that the package does not need (or must not drag along)
NOT_SHIPPED = {".git", ".venv", "build", "runs", "data", "tests", ".pytest_cache", ".hypothesis"}


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DECODER_OPS_LIBRARY",
                                                             "DECODER_NO_CPP_OPS", "TORCH_EXTENSIONS_DIR")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv holding only our package; torch and the rest come from this
    interpreter's site-packages through a .pth line (no download), which adds the
    folder to sys.path without running its .pth files (so not the editable install)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT, src, ignore=lambda d, names: junk(d, names) | (NOT_SHIPPED if d == ROOT else set()))
    env_dir = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "shared-deps.pth"), "w") as fh:
        fh.write("\n".join(site.getsitepackages()) + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        str(src)], cwd=tmp, capture_output=True, text=True, env=clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(src)  # what runs from here on is the installed copy only
    return tmp, env_dir


def test_installed_package_ships_the_op_sources_the_payload_and_the_license(venv):
    tmp, env_dir = venv
    site_dir = glob.glob(str(env_dir / "lib" / "python*" / "site-packages"))[0]
    for f in ("decoder/csrc/fused_cpu.cpp", "decoder/csrc/int8_linear.cpp", "decoder/csrc/checks.h",
              "decoder/csrc/multiversion.h", "decoder/csrc/fused_cuda.cu", "submission/container/run.sh",
              "submission/docker/Dockerfile", "submission/docker/.dockerignore", "tools/convert/__main__.py"):
        assert os.path.isfile(os.path.join(site_dir, f)), f
    # the image's build context from the installed package: the checkout's, file for file
    probe = "from submission import image; print(*(f for f in image.sources() if f[:6] != 'build/'))"
    r = subprocess.run([str(env_dir / "bin" / "python"), "-c", probe], cwd=tmp, capture_output=True, text=True,
                       env=clean_env())
    assert r.stdout.split() == [f for f in sources() if not f.startswith("build/")], r.stderr[-2000:]
    dist = glob.glob(os.path.join(site_dir, "wmt_efficiency_kit-*.dist-info"))[0]
    meta = open(os.path.join(dist, "METADATA")).read()
    assert "License-Expression: Apache-2.0" in meta
    assert "Apache License" in open(os.path.join(dist, "licenses", "LICENSE")).read()


def test_installed_console_script_decodes_with_the_fused_ops_outside_the_repo(venv):
    tmp, env_dir = venv
    ext = tmp / "torch-ext"  # a cold cache: the first decode builds the ops, from the installed sources
    src = tmp / "input.en"
    src.write_text("".join(open(SRC).readlines()[:LINES]))
    args = ["--model", MODEL, "-i", str(src), "--max-sentences", "8"]
    env = clean_env(TORCH_EXTENSIONS_DIR=str(ext), PATH=f"{env_dir / 'bin'}:{os.environ['PATH']}")
    head = ["wmt-kit-translate"]
    r = subprocess.run(head + args, cwd=tmp, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("building the fused C++ ops") == 1, r.stderr
    assert "unavailable" not in r.stderr and "PyTorch reference" not in r.stderr, r.stderr
    lib = glob.glob(str(ext / "decoder_ops-*" / "decoder_ops.so"))
    assert len(lib) == 1

    # the installed decoder, not the checkout's, with the ops loaded; the second run builds nothing
    probe = ("import decoder, sys; from decoder import ops; "
             "print(decoder.__file__.startswith(sys.prefix), ops.available())")
    p = subprocess.run([str(env_dir / "bin" / "python"), "-c", probe], cwd=tmp, capture_output=True,
                       text=True, env=env)
    assert p.stdout.split() == ["True", "True"], p.stderr
    assert "building" not in p.stderr, p.stderr

    # `python -m decoder` in the checkout, on the same library: the same lines
    want = subprocess.run([sys.executable, "-m", "decoder", *args], cwd=ROOT, capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=ROOT, DECODER_OPS_LIBRARY=lib[0]), timeout=600)
    assert want.returncode == 0, want.stderr[-3000:]
    assert r.stdout == want.stdout and len(r.stdout.splitlines()) == LINES


def test_console_scripts_are_the_python_m_commands_and_each_helps_and_says_its_version(venv):
    tmp, env_dir = venv
    py = str(env_dir / "bin" / "python")
    # one interpreter for all (torch imports once): each entry point as its script runs it
    check = """
import contextlib, io, json, sys
from importlib.metadata import distribution
out = {}
for ep in distribution("wmt-efficiency-kit").entry_points:
    for flag in ("--help", "--version"):
        sys.argv = [ep.name, flag]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                code = ep.load()()
            except SystemExit as e:
                code = e.code
        out[f"{ep.name} {flag}"] = [ep.value, code, buf.getvalue()]
print(json.dumps(out))
"""
    r = subprocess.run([py, "-c", check], cwd=tmp, capture_output=True, text=True, env=clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert {k.split()[0] for k in out} == set(SCRIPTS)
    for key, (value, code, text) in out.items():
        name, flag = key.split()
        assert value == SCRIPTS[name] and code in (0, None), (key, code)
        if flag == "--help":
            assert text.startswith("usage:"), key
        else:
            assert text == f"wmt-efficiency-kit {VERSION}\n", (key, text)
    for name in SCRIPTS:  # the scripts themselves exist on PATH
        assert os.access(env_dir / "bin" / name, os.X_OK)
    v = subprocess.run([str(env_dir / "bin" / "wmt-kit-translate"), "--version"], cwd=tmp,
                       capture_output=True, text=True, env=clean_env())
    assert (v.returncode, v.stdout) == (0, f"wmt-efficiency-kit {VERSION}\n")


def python_m_modules() -> list[str]:
    """Every `python -m` command of the kit: each package's __main__.py and each module that runs
    as a program (`if __name__ == "__main__"`), found in the tree so that a new one is counted."""
    out = set()
    for top in ("decoder", "student", "submission", "tools"):
        for d, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "build", "csrc")]
            for n in names:
                path = os.path.join(d, n)
                if not n.endswith(".py"):
                    continue
                with open(path, encoding="utf-8") as fh:
                    runs = n == "__main__.py" or 'if __name__ == "__main__"' in fh.read()
                if runs:
                    out.add(os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__main__"))
    return sorted(out)


def test_the_command_finder_finds_packages_and_runnable_modules():
    modules = python_m_modules()
    assert {"decoder", "student.train", "tools.convert", "tools.synth_corpus", "student.data.bench",
            "submission.container.serve"} <= set(modules)
    assert not any(m.endswith(("__init__", "__main__")) for m in modules)


def test_every_python_m_command_and_console_script_says_its_version():
    modules = python_m_modules()
    # each console script of pyproject.toml is one of these commands (its function is that module's)
    declared = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["scripts"]
    scripts = {v.split(":")[0].removesuffix(".__main__") for v in declared.values()}
    assert scripts <= set(modules), scripts - set(modules)
    out = python_m_each([[m, "--version"] for m in modules], env=clean_env(PYTHONPATH=ROOT))
    assert {m: o[:2] for m, o in zip(modules, out)} == {m: [0, f"wmt-efficiency-kit {VERSION}\n"] for m in modules}


def test_version_without_an_install_comes_from_pyproject(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", missing)
    assert cliargs.version() == f"wmt-efficiency-kit {VERSION}"
