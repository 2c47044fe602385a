"""DECODER_MAX_CPU_ISA caps the ISA of our own kernels (decoder/csrc/multiversion.h), so an
AVX2-capped benchmark runs all of our code on AVX2, not only torch's and CTranslate2's: the
library says which variant it runs (`ops.kernel_isa`, the settings line), and under the cap
every fused op still gives its reference's output."""
import os
import subprocess
import sys

import pytest

from decoder import fused, machine, ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ ops could not be built here (no compiler?)")
def cpu_best() -> str:
    """x86-64-v4 or v3 by the flags machine.py reports (every CPU with AVX-512 BW has the rest of v4)."""
    flags = set(machine.cpu_info()["flags"])
    v3 = {"avx2", "fma"} <= flags
    return "avx512" if v3 and {"avx512f", "avx512bw"} <= flags else "avx2" if v3 else "default"


def run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                               **env})


def test_kernels_run_the_widest_isa_the_cpu_and_the_cap_allow():
    """Also run by the capped children below: there the cap is set."""
    cap = os.environ.get(ops.ISA_CAP, "avx512").lower()
    levels = ops.ISA_LEVELS
    assert ops.kernel_isa() == levels[min(levels.index(cap), levels.index(cpu_best()))]
    assert ops.status()["cpu_isa"] == ops.kernel_isa()
    assert f"cpu yes ({ops.kernel_isa()} kernels" in fused.describe()
    if ops.kernel_isa() != "avx512":  # our VNNI kernels are AVX-512: capped below it, none runs
        assert not ops.int8_gemm_available() and ops.int8_gemv_isa(2) <= 1


# every kernel against its reference (tests/test_fused_ops.py style) and the int8 products
# exact, in a child process per cap, with ATen capped alike (as the bench's capped pass):
# the default variant has no FMA, nor has ATen's default build, so both round alike
UNDER_CAP = ["tests/test_fused_ops.py", "tests/test_int8_gemv.py",
             "tests/test_isa_cap.py::test_kernels_run_the_widest_isa_the_cpu_and_the_cap_allow",
             "tests/test_cross_attention.py::test_cross_attention_equals_sdpa_on_the_projected_kv"]
SELECT = "(match or equal or exact or bit or picks or rounds or reads or widest) and not trained_model"


@pytest.mark.parametrize("cap", ["avx2", "default"])
def test_fused_ops_match_their_references_with_the_kernels_capped(cap):
    if cap == "avx2" and cpu_best() == "default":
        pytest.skip("no AVX2 here")
    if cap == cpu_best():  # the child would rerun the suite's own tests on the same kernels (69 s on Zen 3)
        pytest.skip(f"this CPU's widest kernels are {cap}: the suite's own run is the capped run")
    r = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *UNDER_CAP, "-k", SELECT],
            **{ops.ISA_CAP: cap, "ATEN_CPU_CAPABILITY": cap})
    tail = r.stdout.strip().splitlines()[-1:]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert tail and " passed" in tail[0] and "failed" not in tail[0], tail


def test_cap_names_the_levels_in_any_case_and_a_bad_value_warns():
    assert ops.check_isa_cap({}) is None and ops.check_isa_cap({ops.ISA_CAP: ""}) is None
    assert all(ops.check_isa_cap({ops.ISA_CAP: v}) is None for v in ("avx2", "AVX2", "default", "avx512"))
    assert ops.check_isa_cap({ops.ISA_CAP: "avx3"}) == (
        "warning: DECODER_MAX_CPU_ISA='avx3' is not one of default, avx2, avx512; "
        "the fused C++ ops run this CPU's widest ISA")


def test_a_bad_cap_is_one_warning_line_and_the_kernels_run_uncapped():
    r = run(["-c", "from decoder import fused, ops; assert ops.available(); print(fused.describe())"],
            **{ops.ISA_CAP: "avx3"})
    assert r.returncode == 0, r.stderr
    warnings = [x for x in r.stderr.splitlines() if ops.ISA_CAP in x]
    assert warnings == [ops.check_isa_cap({ops.ISA_CAP: "avx3"})], r.stderr
    assert r.stdout.startswith(f"fused ops: cpu yes ({cpu_best()} kernels, DECODER_MAX_CPU_ISA=avx3)"), r.stdout
