"""tools/cuda_check.py: finding nvcc for the CUDA kernels' build (the build
itself needs a CUDA torch: `make cuda-check`)."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from decoder import toolkit
from tools import cuda_check


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    from torch.utils import cpp_extension
    monkeypatch.setenv("CUDA_HOME", "")  # so that delenv restores what was there, even nothing
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)  # toolkit.use sets it
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # restored afterwards
    monkeypatch.setattr(toolkit, "SYSTEM_CUDA", str(tmp_path / "no-system-cuda"))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return monkeypatch


def _wheel_toolkit(root, major="13"):
    home = root / "site" / "nvidia" / f"cu{major}"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    (home / "lib").mkdir()
    (home / "lib" / "libcudart.so.13").write_text("")
    return home


def test_wheel_toolkit_of_torchs_cuda_major_is_found_and_gets_a_libcudart_link(clean_env, tmp_path):
    home = _wheel_toolkit(tmp_path)
    _wheel_toolkit(tmp_path / "other", major="12")  # another major: never picked
    clean_env.setattr(sys, "path", [str(tmp_path / "other" / "site"), str(tmp_path / "site")] + sys.path)
    assert cuda_check.find_toolkit() == str(home)
    assert os.readlink(home / "lib" / "libcudart.so") == "libcudart.so.13"
    assert os.environ["CUDA_HOME"] == str(home)
    assert os.environ["PATH"].split(os.pathsep)[0] == str(home / "bin")


def test_cuda_home_wins_over_the_wheels(clean_env, tmp_path):
    _wheel_toolkit(tmp_path)
    clean_env.setattr(sys, "path", [str(tmp_path / "site")] + sys.path)
    clean_env.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert cuda_check.find_toolkit() == str(tmp_path / "toolkit")


def test_cpu_torch_without_venv_is_one_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(SystemExit) as e:
        cuda_check.main([])
    assert e.value.code == 2
    assert "--venv" in capsys.readouterr().err


def test_torch_version_without_venv_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        cuda_check.main(["--torch", "2.11.0"])
    assert e.value.code == 2 and "--torch VERSION needs --venv DIR" in capsys.readouterr().err


def test_a_venv_holding_another_torch_version_gets_the_one_asked_for(monkeypatch, tmp_path):
    """make gpu-carry builds for the lent machine's torch: a venv left with another version (an
    earlier GPU_TORCH) must not build the carried libraries against it."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    have = {"torch": "2.13.0"}
    installs = []

    def run(cmd, env=None, check=False, **kw):
        installs.append(next(a for a in cmd if a.startswith("torch==")))
        have["torch"] = installs[-1].split("==")[1]
    monkeypatch.setattr(cuda_check.subprocess, "run", run)
    monkeypatch.setattr(cuda_check, "_cuda_of", lambda py: "13.0")
    monkeypatch.setattr(cuda_check, "_torch_of", lambda py: have["torch"])
    monkeypatch.setattr(cuda_check, "_nvcc", lambda py, major: "nvcc")
    cuda_check.setup_venv(str(tmp_path), "2.11.0")
    cuda_check.setup_venv(str(tmp_path), "2.11.0")  # now it holds it: nothing installed
    assert installs == ["torch==2.11.0"]


def test_the_check_wants_a_kernel_for_each_op_the_cuda_source_registers(tmp_path):
    """Not every op has a CUDA kernel (the int8 GEMMs, the one-row CPU steps): the
    check expects those fused_cuda.cu registers for CUDA, and only those."""
    cu = tmp_path / "k.cu"
    cu.write_text('TORCH_LIBRARY_IMPL(decoder_ops, CPU, m) {\n  m.impl("cpu_op", &f);\n}\n'
                  'TORCH_LIBRARY_IMPL(decoder_ops, CUDA, m) {\n  m.impl("a_", &a);\n  m.impl("b", &b);\n}\n')
    assert cuda_check.cuda_ops(str(cu)) == {"a_", "b"}
    assert {"decode_attention", "add_bias_residual_layernorm"} <= cuda_check.cuda_ops()
    assert "int8_gemm" not in cuda_check.cuda_ops()


@pytest.mark.parametrize("cuda,found,installs", [
    (None, None, False),               # a CPU torch: nothing to build
    ("13.0", "/usr/local/cuda", False),  # a toolkit is there
    ("13.0", None, True),              # a pip-only GPU machine: the nvcc wheels
    ("12.8", None, False),             # no nvcc wheels before CUDA 13: a note, nothing installed
])
def test_setup_installs_nvcc_only_for_a_cuda_torch_without_a_toolkit(monkeypatch, capsys, cuda, found, installs):
    calls = []
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(toolkit, "find", lambda c: found)
    monkeypatch.setattr(cuda_check.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert cuda_check.main(["--install-nvcc"]) == 0
    assert calls == ([[sys.executable, "-m", "pip", "install", "-q", *toolkit.nvcc_wheels("13.0")]]
                     if installs else [])
    assert ("no nvcc on PyPI" in capsys.readouterr().err) == (cuda == "12.8")
    assert toolkit.nvcc_wheels("13.0")[0] == "nvidia-cuda-nvcc==13.0.*" and toolkit.nvcc_wheels("12.8") == []


def test_make_setup_asks_for_nvcc_after_torch():
    r = subprocess.run(["make", "-s", "-n", "-B", "setup", "PY=python3"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    lines = [x for x in r.stdout.splitlines() if " -m pip install" in x or "--install-nvcc" in x]
    assert "--install-nvcc" in lines[-1] and "torch==" in " ".join(lines[:-1])
