"""decoder/csrc compiles as C++17.

torch 2.11 and older build extensions with -std=c++17 (2.13 with -std=c++20), so
one C++20-only construct (it was std::bit_cast) made the build fail there and
every fused op fall back to its reference without a word (issue 30). The build
flags are torch's own and never forced; this test forces C++17 on a syntax-only
compile of each CPU source, whatever torch is installed. fused_cuda.cu needs
CUDA's headers: `make cuda-check` compiles it with nvcc.
"""
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.utils import cpp_extension

from decoder import ops

CXX = os.environ.get("CXX") or "c++"
pytestmark = pytest.mark.skipif(shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX})")


def syntax_check(path: str, std: str = "c++17") -> subprocess.CompletedProcess:
    """`path` parsed and type-checked as `std` (no code generated) against this torch's headers.
    -isystem: torch's own headers may use C++20 extensions (2.13's do) and warn; ours may not."""
    inc = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    cmd = [CXX, "-fsyntax-only", f"-std={std}", *ops.CFLAGS, *(a for d in inc for a in ("-isystem", d)),
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-DTORCH_EXTENSION_NAME=decoder_ops",
           "-Werror=c++20-extensions", "-Werror=c++20-compat", path]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_every_cpu_source_compiles_as_cpp17():
    paths = [os.path.join(ops._HERE, f) for f in ops.SOURCES]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:  # ~9 s of CPU each, headers mostly
        results = list(pool.map(syntax_check, paths))
    failed = {os.path.basename(p): r.stderr.strip().splitlines()[-5:] for p, r in zip(paths, results) if r.returncode}
    assert not failed, failed


def test_the_check_catches_a_cpp20_only_construct(tmp_path):
    # what fused_cpu.cpp once had: the check must fail it, or the test above proves nothing
    src = tmp_path / "bit_cast.cpp"
    src.write_text("#include <bit>\n#include <cstdint>\n"
                   "float scale(int32_t k) { return std::bit_cast<float>((k + 127) << 23); }\n")
    assert syntax_check(str(src)).returncode != 0
    assert syntax_check(str(src), std="c++20").returncode == 0
