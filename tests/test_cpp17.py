"""decoder/csrc compiles as C++17.

torch 2.11 and older build extensions with -std=c++17 (2.13 with -std=c++20), so
one C++20-only construct (it was std::bit_cast) made the build fail there and
every fused op fall back to its reference without a word (issue 30). The build
flags are torch's own and never forced; this test forces C++17 on a syntax-only
compile of each CPU source against the installed torch's headers, where those
take C++17 (to 2.13; 2.14 on refuse it). fused_cuda.cu needs CUDA's headers:
`make cuda-check` compiles it with nvcc.
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


def torch_includes() -> list[str]:
    """-isystem: torch's own headers may use C++20 extensions (2.13's do) and warn; ours may not."""
    inc = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [a for d in inc for a in ("-isystem", d)]


def headers_refuse_cpp17(includes: list[str]) -> bool:
    """torch 2.14 on refuses C++17 in its own headers (`#error C++20 or later ...`): against
    those the check cannot run, and C++17 is checked on the torch `make setup` pins (what CI
    runs) and by `make oldest-torch-check`. Preprocessing alone shows it, in about a second."""
    r = subprocess.run([CXX, "-E", "-std=c++17", *includes, "-x", "c++", "-"], input="#include <ATen/ATen.h>\n",
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return r.returncode != 0 and "C++20" in r.stderr


def syntax_check(path: str, std: str = "c++17") -> subprocess.CompletedProcess:
    """`path` parsed and type-checked as `std` (no code generated) against this torch's headers."""
    cmd = [CXX, "-fsyntax-only", f"-std={std}", *ops.CFLAGS, *torch_includes(),
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-DTORCH_EXTENSION_NAME=decoder_ops",
           "-Werror=c++20-extensions", "-Werror=c++20-compat", path]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_every_cpu_source_compiles_as_cpp17():
    if headers_refuse_cpp17(torch_includes()):
        pytest.skip(f"torch {torch.__version__}'s own headers need C++20: checked on older torch")
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


def test_headers_that_refuse_cpp17_are_told_from_ones_that_take_it(tmp_path):
    for name, guard in (("new", "#if __cplusplus < 202002L\n#error C++20 or later compatible compiler is required\n"
                                "#endif\n"), ("old", "")):
        (tmp_path / name / "ATen").mkdir(parents=True)
        (tmp_path / name / "ATen" / "ATen.h").write_text(f"#pragma once\n{guard}int aten_version = 1;\n")
    assert headers_refuse_cpp17(["-isystem", str(tmp_path / "new")])
    assert not headers_refuse_cpp17(["-isystem", str(tmp_path / "old")])
