"""Where nvcc is, for the CUDA kernels' build (decoder/ops.py, tools/cuda_check.py).

torch finds a CUDA toolkit in $CUDA_HOME, /usr/local/cuda or through nvcc on
$PATH. A GPU machine set up with pip alone has none of them, and the kit then ran
its PyTorch references on the GPU. From CUDA 13, PyPI ships nvcc as wheels
(`nvidia-cuda-nvcc` and its companions, laid out under site-packages/nvidia/cuNN),
which `make setup` installs where a CUDA torch finds no toolkit
(tools/cuda_check.py `--install-nvcc`); `wheels` finds them and `use` points torch's
extension build at them.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys

SYSTEM_CUDA = "/usr/local/cuda"
# the wheels that make a toolkit nvcc can build with: compiler, its front end, headers, runtime
NVCC_WHEELS = ("cuda-nvcc", "nvvm", "cuda-crt", "cuda-cccl", "cuda-runtime")


def nvcc_wheels(cuda: str) -> list[str]:
    """The pip requirements of nvcc for torch's CUDA version `cuda` ("13.0"); [] before
    CUDA 13, whose wheels hold no nvcc in this layout."""
    major, minor = cuda.split(".")[:2]
    return [f"nvidia-{n}=={major}.{minor}.*" for n in NVCC_WHEELS] if int(major) >= 13 else []


def wheels(cuda: str | None) -> str | None:
    """The nvidia/cuNN folder of pip wheels holding nvcc for CUDA major of `cuda`, or None. Gives
    its lib/ the libcudart.so link the extension's -lcudart needs (the wheels ship
    libcudart.so.NN only), where the folder can be written."""
    if not cuda:
        return None
    major = cuda.split(".")[0]
    found = sorted(p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia", f"cu{major}", "bin", "nvcc")))
    if not found:
        return None
    home = os.path.dirname(os.path.dirname(found[0]))
    lib = os.path.join(home, "lib")
    so = sorted(glob.glob(os.path.join(lib, "libcudart.so.*")))
    if so and not os.path.exists(os.path.join(lib, "libcudart.so")):
        try:
            os.symlink(os.path.basename(so[0]), os.path.join(lib, "libcudart.so"))
        except OSError:  # a read-only site-packages: the link step may still find it
            pass
    return home


def find(cuda: str | None) -> str | None:
    """CUDA_HOME for a build against torch's CUDA `cuda`: $CUDA_HOME, /usr/local/cuda, the pip
    wheels (`wheels`), or nvcc on $PATH, in that order (a /usr/local/bin/nvcc may be a wrapper
    script, so PATH comes last)."""
    home = os.environ.get("CUDA_HOME")
    if not home and os.path.exists(os.path.join(SYSTEM_CUDA, "bin", "nvcc")):
        home = SYSTEM_CUDA
    home = home or wheels(cuda)
    if not home and shutil.which("nvcc"):
        home = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc"))))
    return home


def use(home: str) -> str:
    """Point this process's extension builds at the toolkit `home`: $CUDA_HOME and $PATH, and
    torch's own copy, which torch.utils.cpp_extension read once when it was imported."""
    os.environ["CUDA_HOME"] = home
    os.environ["PATH"] = os.path.join(home, "bin") + os.pathsep + os.environ.get("PATH", "")
    ext = sys.modules.get("torch.utils.cpp_extension")
    if ext is not None:
        ext.CUDA_HOME = home
    return home
