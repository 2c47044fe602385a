"""python -m tools.cuda_check [--venv DIR [--torch VERSION]] [--arch LIST] [--build-dir DIR] [--out DIR]

Compiles the CUDA kernels (decoder/csrc/fused_cuda.cu) with nvcc against a CUDA
build of torch and checks that every fused op then has a CUDA kernel
registered. No GPU is needed: without one the targets come from --arch. On a
GPU machine, tests/test_fused_ops.py then runs the kernels against their
references.

From the kit's own venv (CPU torch), --venv DIR makes DIR a second venv holding
the CUDA build of the same torch version and, for CUDA 13 and later, nvcc from
PyPI's nvidia-* wheels (about 5 GB), and runs the check there. An installed
toolkit ($CUDA_HOME, /usr/local/cuda) comes before the wheels' nvcc.
--out DIR copies the two libraries it built there: the GPU submission image
loads them prebuilt (submission/image.py).
"""
from __future__ import annotations

import ast
import glob
import hashlib
import os
import shutil
import re
import subprocess
import sys
import time

from decoder import toolkit
from decoder.cliargs import ArgumentParser, add_version


def _run(cmd, env=None, stderr=None) -> str:
    return subprocess.run(cmd, env=env, check=True, text=True, stdout=subprocess.PIPE, stderr=stderr).stdout.strip()


def setup_venv(venv: str, torch_version: str, find_links: str | None = None) -> str:
    """DIR/bin/python with the CUDA torch `torch_version` and nvcc; returns its path.
    find_links: a folder of wheels tried before PyPI (the GPU image's wheelhouse
    holds this torch's CUDA build and its nvidia-* libraries: no second 3 GB download)."""
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    env = registry_env()
    pip = [py, "-m", "pip", "install", "-q", *(["--find-links", find_links] if find_links else [])]
    if not _cuda_of(py) or _torch_of(py) != torch_version:
        print(f"installing torch=={torch_version} (CUDA build) into {venv} ...", flush=True)
        subprocess.run(pip + [f"torch=={torch_version}", "numpy", "ninja"], env=env, check=True)
    cuda = _cuda_of(py)
    if not cuda:
        sys.exit(f"error: PyPI gave torch=={torch_version} without CUDA; install a CUDA build into {venv} by hand")
    if not _nvcc(py, cuda) and toolkit.nvcc_wheels(cuda):
        print(f"installing nvcc {cuda} (nvidia-cuda-nvcc wheels) ...", flush=True)
        subprocess.run(pip + toolkit.nvcc_wheels(cuda), env=env, check=True)
    return py


def registry_env() -> dict:
    """This environment with pip on the package registry alone: a local wheel folder
    or constraint may pin the CPU build of this torch version, which pip would prefer."""
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    for k in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL"):
        env.pop(k, None)
    return env


def _cuda_of(py: str) -> str:
    try:
        # a venv without torch yet is the normal first run: no traceback for it
        return _run([py, "-c", "import torch; print(torch.version.cuda or '')"], stderr=subprocess.DEVNULL)
    except (subprocess.CalledProcessError, OSError):
        return ""


def _torch_of(py: str) -> str:
    """The venv's torch version without its local tag (2.11.0 of 2.11.0+cu130)."""
    try:
        return _run([py, "-c", "import torch; print(torch.__version__.split('+')[0])"], stderr=subprocess.DEVNULL)
    except (subprocess.CalledProcessError, OSError):
        return ""


def _nvcc(py: str, cuda: str) -> str:
    """The wheels' toolkit of the venv's python `py` (decoder/toolkit.py `wheels`, asked there), or ""."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"from decoder import toolkit; print(toolkit.wheels({cuda!r}) or '')"
    return _run([py, "-c", code], env=dict(os.environ, PYTHONPATH=root))


def cuda_ops(source: str | None = None) -> set[str]:
    """The ops fused_cuda.cu registers for CUDA: each must have its kernel once the
    library loads. The rest (the int8 GEMMs, the one-row CPU steps, ...) are CPU only."""
    if source is None:
        from decoder import ops
        source = os.path.join(ops._HERE, "fused_cuda.cu")
    text = open(source).read()
    block = re.search(r"TORCH_LIBRARY_IMPL\(decoder_ops,\s*CUDA,\s*m\)\s*\{(.*?)\n\}", text, re.S)
    return set(re.findall(r'm\.impl\("(\w+)"', block.group(1))) if block else set()


DIGEST = "sources.sha256"  # beside the libraries --out copies: what they were built from


# the names in decoder/ops.py that reach the compiler; the rest of the file (locks, loading) does not
BUILD_NAMES = ("SOURCES", "CFLAGS", "CUDA_CFLAGS")


def build_inputs(ops_py: str) -> str:
    """decoder/ops.py's assignments to BUILD_NAMES, as source text: what of it a build depends on."""
    tree = ast.parse(open(ops_py).read())
    return "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id in BUILD_NAMES for t in n.targets))


def sources_digest(csrc: str | None = None) -> str:
    """sha256 of decoder/csrc (each file's name and bytes) and decoder/ops.py's build inputs (sources
    and flags): a library carried to another machine is taken there only while this is what it was
    built from. The rest of ops.py is left out, so an edit to how the ops load keeps a carried build."""
    if csrc is None:
        from decoder import ops
        csrc = ops._HERE
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(csrc, "*"))):
        h.update(os.path.basename(path).encode() + b"\0" + open(path, "rb").read() + b"\0")
    h.update(b"ops.py\0" + build_inputs(os.path.join(os.path.dirname(csrc), "ops.py")).encode())
    return h.hexdigest()


def find_toolkit() -> str | None:
    """CUDA_HOME for the build (decoder/toolkit.py `find`: $CUDA_HOME, /usr/local/cuda, the
    nvidia/cuNN folder of pip wheels matching this torch, nvcc on $PATH), set for this process."""
    import torch
    home = toolkit.find(torch.version.cuda)
    return toolkit.use(home) if home else None


def install_nvcc() -> int:
    """`make setup`: nvcc from the package registry into this venv where its torch is a CUDA
    build of 13 or later and no toolkit is found, so the first decode on the GPU builds the CUDA
    kernels instead of running the PyTorch references. Nothing on a CPU torch."""
    import torch
    cuda = torch.version.cuda
    if not cuda or toolkit.find(cuda):
        return 0
    want = toolkit.nvcc_wheels(cuda)
    if not want:
        print(f"note: torch's CUDA {cuda} has no nvcc on PyPI; the CUDA kernels need a CUDA toolkit "
              "($CUDA_HOME or /usr/local/cuda)", file=sys.stderr)
        return 0
    print(f"installing nvcc {cuda} for the CUDA kernels (nvidia-cuda-nvcc wheels) ...", flush=True)
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", *want], env=registry_env()).returncode


def check(arch: str, build_dir: str | None, verbose: bool, out: str | None = None) -> int:
    import torch
    home = find_toolkit()
    if home is None:
        print("error: no nvcc: set CUDA_HOME, put nvcc on PATH, or use --venv (CUDA 13+ wheels)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", arch)
    from decoder import ops
    if not ops.available():
        print(f"error: the CPU library (op schemas) did not build ({ops.status()['cpu_why']})", file=sys.stderr)
        return 1
    nvcc = _run([os.path.join(home, "bin", "nvcc"), "--version"]).splitlines()[-1]
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {nvcc}, "
          f"targets {os.environ.get('TORCH_CUDA_ARCH_LIST', 'this GPU')}, GPU: {torch.cuda.is_available()}",
          flush=True)
    t0 = time.perf_counter()
    try:
        ops.build_cuda_library(build_dir, verbose=verbose)
    except Exception as e:
        print(f"FAILED to build csrc/fused_cuda.cu: {e}", file=sys.stderr)
        return 1
    print(f"built and loaded decoder_ops_cuda in {time.perf_counter() - t0:.0f} s")
    names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("decoder_ops::"))
    want = cuda_ops()
    missing = sorted(want - set(names)) if want else ["(no TORCH_LIBRARY_IMPL(decoder_ops, CUDA) in fused_cuda.cu)"]
    for n in names:
        ok = torch._C._dispatch_has_kernel_for_dispatch_key(f"decoder_ops::{n}", "CUDA")
        print(f"  {n:32s} " + ("CUDA kernel registered" if ok else "CUDA kernel MISSING" if n in want else "CPU only"))
        if n in want and not ok:
            missing.append(n)
    if missing:
        print(f"FAILED: no CUDA kernel for {', '.join(missing)}", file=sys.stderr)
        return 1
    if out:
        from torch.utils.cpp_extension import _get_build_directory
        os.makedirs(out, exist_ok=True)
        for so in (os.path.join(ops.default_build_dir(), "decoder_ops.so"),
                   os.path.join(build_dir or _get_build_directory("decoder_ops_cuda", False), "decoder_ops_cuda.so")):
            shutil.copyfile(so, os.path.join(out, os.path.basename(so)))
            os.chmod(os.path.join(out, os.path.basename(so)), 0o644)
        with open(os.path.join(out, DIGEST), "w") as fh:
            fh.write(sources_digest() + "\n")
        print(f"copied decoder_ops.so and decoder_ops_cuda.so to {out}, with the digest of their sources")
    print("ok" + ("" if torch.cuda.is_available() else "; no GPU here, so the kernels were not run"))
    return 0


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m tools.cuda_check", description=__doc__.split("\n\n")[1])
    add_version(p)
    p.add_argument("--venv", help="when this torch has no CUDA: make/use this venv with the CUDA build and nvcc")
    p.add_argument("--arch", default="8.0;9.0",
                   help="targets without a GPU (TORCH_CUDA_ARCH_LIST wins when set; default: %(default)s)")
    p.add_argument("--build-dir", help="where the library is built (default: torch's extension cache)")
    p.add_argument("--torch", metavar="VERSION",
                   help="with --venv: the CUDA torch to build against (default: this torch's version; the "
                        "libraries load only into the torch they were built for, as a lent GPU machine's)")
    p.add_argument("--find-links", help="with --venv: a folder of wheels tried before the registry (the CUDA torch)")
    p.add_argument("--out", help="copy the built CPU and CUDA libraries into this folder")
    p.add_argument("--verbose", action="store_true", help="show the nvcc and ninja commands")
    p.add_argument("--install-nvcc", action="store_true",
                   help="only install nvcc from the registry into this venv where its torch is a CUDA build "
                        "(13 or later) and no toolkit is found (make setup), then exit")
    a = p.parse_args(argv)
    if a.install_nvcc:
        return install_nvcc()
    import torch
    if a.torch and not a.venv:
        p.error("--torch VERSION needs --venv DIR: the venv it is installed into")
    if torch.version.cuda is None:
        if not a.venv:
            p.error("this torch is a CPU build; pass --venv DIR to check in a venv with the CUDA build")
        py = setup_venv(a.venv, a.torch or torch.__version__.split("+")[0], a.find_links)
        rest = ["--arch", a.arch] + (["--build-dir", os.path.abspath(a.build_dir)] if a.build_dir else []) + \
            (["--out", os.path.abspath(a.out)] if a.out else []) + (["--verbose"] if a.verbose else [])
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run([py, "-m", "tools.cuda_check"] + rest, cwd=root).returncode
    return check(a.arch, a.build_dir, a.verbose, a.out)


if __name__ == "__main__":
    sys.exit(main())
