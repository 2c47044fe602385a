"""A failed build of the fused ops is visible: decoder/ops.py says whether the CPU ops
and the CUDA kernels are loaded and, if not, why (decoder/fused.py `describe`, after the
CUDA kernels' self-check); the decoder's settings line and
`make setup` print it (issue 30: a C++20 construct once failed the build on older
torch with one warning line, and every op then silently ran its slow reference)."""
import os
import re
import shutil
import subprocess
import sys
import threading
import types

import pytest
import torch

from decoder import fused, ops
from decoder.runtime import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NINJA_FAILURE = ("Error building extension 'decoder_ops': [1/5] c++ -MMD -MF fused_cpu.o.d -std=c++17 -O3 -c "
                 "/somewhere/decoder/csrc/fused_cpu.cpp -o fused_cpu.o\nFAILED: fused_cpu.o\n"
                 "/somewhere/decoder/csrc/fused_cpu.cpp:109:28: error: 'bit_cast' is not a member of 'std'\n"
                 "ninja: build stopped: subcommand failed.\n")


@pytest.fixture
def fresh(monkeypatch):
    """ops as in a new process: nothing decided yet (the library itself stays loaded)."""
    monkeypatch.setattr(ops, "_state", {})
    monkeypatch.delenv("DECODER_NO_CPP_OPS", raising=False)
    monkeypatch.delenv("DECODER_OPS_LIBRARY", raising=False)


def settings_line() -> str:
    """The line for a translator whose plan summary is PLAN: the fused-ops clause stands before it."""
    tr = types.SimpleNamespace(precision="fp32", pool=None, device="cpu",
                               plan=types.SimpleNamespace(summary=lambda precision: "PLAN"),
                               opts=types.SimpleNamespace(max_tokens=1536, max_sentences=512))
    return describe(tr, "fp32").removesuffix("; PLAN; batches 1536 tokens x 512")


def head() -> str:
    n = torch.get_num_threads()
    isa = torch.backends.cpu.get_cpu_capability()
    return f"decoder: precision fp32, {n} thread{'s' if n > 1 else ''}, cpu ISA {isa}"


@pytest.mark.skipif(not ops.available() or torch.cuda.is_available(), reason="needs the CPU ops built, no GPU")
def test_settings_line_says_the_cpu_ops_are_loaded():
    assert ops.status() == {"cpu": True, "cuda": False, "cpu_why": "", "cuda_why": "no GPU",
                            "cpu_isa": ops.kernel_isa()}
    assert ops.kernel_isa() in ops.ISA_LEVELS
    cap = f", DECODER_MAX_CPU_ISA={os.environ[ops.ISA_CAP]}" if os.environ.get(ops.ISA_CAP) else ""
    assert settings_line() == head() + f"; fused ops: cpu yes ({ops.kernel_isa()} kernels{cap}), cuda no (no GPU)"


def test_settings_line_says_why_a_failed_build_left_the_ops_out(fresh, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError(NINJA_FAILURE)
    monkeypatch.setattr(ops, "build_library", fail)
    assert not ops.available()
    assert settings_line() == head() + ("; fused ops: cpu no (build failed: fused_cpu.cpp:109:28: error: 'bit_cast' "
                                        "is not a member of 'std'), cuda no (the CPU ops are not loaded)")


def test_settings_line_says_the_ops_were_switched_off(fresh, monkeypatch):
    monkeypatch.setenv("DECODER_NO_CPP_OPS", "1")
    assert fused.describe() == "fused ops: cpu no (off: DECODER_NO_CPP_OPS), cuda no (off: DECODER_NO_CPP_OPS)"


def test_cuda_reasons_name_a_missing_nvcc_and_a_failed_nvcc_build(fresh, monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.setattr(ops, "build_library", lambda *a, **k: None)  # the library is loaded already
    monkeypatch.setattr(ops, "_register_fakes", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.1")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.delenv(ops.ISA_CAP, raising=False)
    yes = f"cpu yes ({ops.kernel_isa()} kernels)"
    assert ops.available() and \
        fused.describe() == f"fused ops: {yes}, cuda no (no nvcc (CUDA_HOME, or the nvcc wheels of make setup))"

    def nvcc_fails(*a, **k):
        raise RuntimeError("Error building extension 'decoder_ops_cuda'\nfused_cuda.cu(12): error: identifier x")
    monkeypatch.setattr(ops, "_state", {})
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(ops, "build_cuda_library", nvcc_fails)
    assert fused.describe() == f"fused ops: {yes}, cuda no (build failed: fused_cuda.cu(12): error: identifier x)"



def test_cuda_kernels_build_with_the_nvcc_wheels_where_no_toolkit_is_installed(fresh, monkeypatch, tmp_path):
    """A GPU machine set up with pip alone: torch finds no CUDA_HOME, make setup installed the nvcc
    wheels (site-packages/nvidia/cu13), and the build takes them instead of the references."""
    from torch.utils import cpp_extension
    home = tmp_path / "site" / "nvidia" / "cu13"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    (home / "lib").mkdir()
    (home / "lib" / "libcudart.so.13").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")] + sys.path)
    monkeypatch.setattr(ops, "build_library", lambda *a, **k: None)
    monkeypatch.setattr(ops, "_register_fakes", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setenv("CUDA_HOME", "restored after the test")
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))
    built = []
    monkeypatch.setattr(ops, "build_cuda_library", lambda *a, **k: built.append(cpp_extension.CUDA_HOME))
    assert ops.available() and ops.cuda_available() and built == [str(home)]
    assert os.environ["PATH"].split(os.pathsep)[0] == str(home / "bin")
    assert os.readlink(home / "lib" / "libcudart.so") == "libcudart.so.13"  # for the link's -lcudart


def test_settings_line_says_the_self_check_refused_cuda_kernels_that_built(fresh, monkeypatch, capsys):
    # built and loaded, then wrong on this GPU: the clause says so, not "cuda yes"
    monkeypatch.setattr(ops, "build_library", lambda *a, **k: None)
    monkeypatch.setattr(ops, "_register_fakes", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "_build_cuda", lambda: True)
    monkeypatch.setattr(fused, "_cuda", {})
    monkeypatch.setattr(fused, "self_check", lambda device: ["argmax_rows"] if device == "cuda" else [])
    monkeypatch.delenv(ops.ISA_CAP, raising=False)
    assert ops.status()["cuda"]
    assert fused.describe() == (f"fused ops: cpu yes ({ops.kernel_isa()} kernels), "
                                "cuda no (disagree with their references: argmax_rows)")
    assert "disagree with their references (argmax_rows)" in capsys.readouterr().err

def test_make_setup_ends_by_printing_the_same_status_line():
    recipe = open(os.path.join(ROOT, "Makefile")).read().split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0]
    code = re.findall(r'\$\(VPY\) -c "([^"]*decoder import fused[^"]*)"', recipe)
    assert len(code) == 1, recipe
    r = subprocess.run([sys.executable, "-c", code[0]], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT, "DECODER_NO_CPP_OPS": "1"})
    assert r.stdout == "fused ops: cpu no (off: DECODER_NO_CPP_OPS), cuda no (off: DECODER_NO_CPP_OPS)\n", r.stderr


def test_a_build_lock_left_by_a_stopped_build_is_cleared_not_waited_on(tmp_path, capsys, monkeypatch):
    # torch's load() (to 2.13) waits forever while `lock` exists; a build killed half-way leaves it
    monkeypatch.setattr(ops, "load_waits_on_lock_file", lambda: True)
    (tmp_path / "lock").write_text("")
    with ops.exclusive_build(str(tmp_path)):
        assert not (tmp_path / "lock").exists()
    assert "removed a stale build lock" in capsys.readouterr().err


def test_the_lock_file_of_a_torch_that_flocks_it_is_left_alone(tmp_path, capsys, monkeypatch):
    # torch 2.14 on keeps `lock` after every build: removing it warned at every start
    monkeypatch.setattr(ops, "load_waits_on_lock_file", lambda: False)
    (tmp_path / "lock").write_text("")
    with ops.exclusive_build(str(tmp_path)):
        assert (tmp_path / "lock").exists()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("waits", [True, False])
def test_a_stop_during_the_build_removes_the_lock_file_only_where_torch_would_wait_on_it(tmp_path, monkeypatch,
                                                                                       waits):
    from decoder import lifecycle
    building = threading.Lock()
    building.acquire()
    monkeypatch.setattr(ops, "_lock", building)
    monkeypatch.setattr(ops, "_state", {})
    monkeypatch.setattr(ops, "default_build_dir", lambda: str(tmp_path))
    monkeypatch.setattr(ops, "load_waits_on_lock_file", lambda: waits)
    (tmp_path / "lock").write_text("")
    lifecycle.release_ops_build()
    assert (tmp_path / "lock").exists() != waits


def test_which_kind_of_build_lock_this_torch_takes_is_read_from_its_loader():
    from torch.utils import cpp_extension
    loader = open(cpp_extension.__file__).read()
    assert ops.load_waits_on_lock_file() == ("FileBaton(os.path.join(build_directory, 'lock'))" in loader)


def test_a_build_running_in_another_process_is_waited_for_and_its_lock_kept(tmp_path):
    holding, release, entered = threading.Event(), threading.Event(), []

    def first():  # flock is per open file: a thread stands in for another process
        with ops.exclusive_build(str(tmp_path)):
            (tmp_path / "lock").write_text("")  # torch's baton, taken inside
            holding.set()
            release.wait(30)
            (tmp_path / "lock").unlink()  # and released when its build ends

    def second():
        with ops.exclusive_build(str(tmp_path)):
            entered.append(True)

    t1, t2 = threading.Thread(target=first), threading.Thread(target=second)
    t1.start()
    assert holding.wait(30)
    t2.start()
    t2.join(0.5)
    assert not entered and (tmp_path / "lock").exists()
    release.set()
    t1.join(30), t2.join(30)
    assert entered == [True]


@pytest.mark.skipif(not ops.available(), reason="needs the CPU ops built")
def test_loading_the_library_from_a_build_folder_with_a_stale_lock_returns(tmp_path):
    build = tmp_path / "build"
    shutil.copytree(ops.default_build_dir(), build, ignore=shutil.ignore_patterns("lock", "kit.flock"))
    (build / "lock").write_text("")
    r = subprocess.run([sys.executable, "-c", f"from decoder import ops; ops.build_library({str(build)!r})"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("removed a stale build lock" in r.stderr) == ops.load_waits_on_lock_file(), r.stderr[-2000:]


def test_the_cpu_library_is_stale_after_its_sources_or_headers_change_not_the_cuda_file(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name in ("fused_cpu.cpp", "checks.h", "fused_cuda.cu"):
        (csrc / name).write_text("")
        os.utime(csrc / name, (100, 100))
    so = tmp_path / "decoder_ops.so"
    monkeypatch.setattr(ops, "_HERE", str(csrc))
    assert ops._stale(str(so))  # not built yet
    so.write_text("")
    os.utime(so, (200, 200))
    assert not ops._stale(str(so))
    os.utime(csrc / "fused_cuda.cu", (300, 300))  # an edit of the CUDA kernels: no CPU rebuild announced
    assert not ops._stale(str(so))
    for name in ("checks.h", "fused_cpu.cpp"):
        os.utime(csrc / name, (300, 300))
        assert ops._stale(str(so)), name
        os.utime(csrc / name, (100, 100))
