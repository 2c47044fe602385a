"""Fused C++ ops (decoder/csrc), compiled on first use and cached.

Built with torch.utils.cpp_extension into $TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions; `make setup` builds it, else the first decode does,
saying so in one stderr line), or loaded prebuilt from $DECODER_OPS_LIBRARY (the
submission image: it has no compiler, so `make image` builds the library on
the host, which runs the same torch and glibc; the GPU image also loads its
CUDA kernels, compiled ahead of time, from $DECODER_OPS_CUDA_LIBRARY). Where neither works
`available()` is False and callers use the plain PyTorch reference
(decoder/quant.py, decoder/fused.py), which the tests check the ops against;
`status()` says which of the CPU ops and CUDA kernels loaded and why not
(decoder/fused.py's `describe` prints it for the decoder's settings line and
`make setup`, after the CUDA kernels' self-check).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import threading

import torch

_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = ("int8_linear.cpp", "int8_gemm.cpp", "int8_gemv.cpp", "fused_cpu.cpp", "shortlist.cpp")
# -fopenmp, not just -fopenmp-simd: at::parallel_for is an OpenMP region compiled into the
# caller, so without it every op ran serially in a multi-threaded process; the GOMP calls
# resolve to the libgomp torch itself loads
CFLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
CUDA_CFLAGS = ["-O3"]
_lock = threading.Lock()
_state: dict = {}


class OpArgumentError(ValueError, RuntimeError):
    """Bad arguments to a fused op, refused in Python before the kernel runs: on some
    torch builds and compilers the C++ exception of a kernel's own check (TORCH_CHECK,
    kept as a second line) crashed the process instead of raising (issue 30).
    A RuntimeError too, as the op's own error is."""


def require(ok: bool, message) -> None:
    """The op wrappers' argument checks: shapes and ints in the decode step; a check
    that reads tensor data runs on CPU tensors or once per batch, never as a per-step
    device sync. `message`: a string, or a function giving it (an f-string formatted
    at every call cost the step microseconds)."""
    if not ok:
        raise OpArgumentError(message() if callable(message) else message)


def available() -> bool:
    ok = _state.get("ok")
    if ok is not None:  # the decode step asks several times per layer: no lock once decided
        return ok
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
        return _state["ok"]


def status() -> dict:
    """Whether the CPU ops and the CUDA kernels are loaded, and if not why, in a few
    words: {"cpu": bool, "cuda": bool, "cpu_why": str, "cuda_why": str} ("" when
    loaded), and "cpu_isa": the ISA the CPU kernels run (`kernel_isa`; "" when not
    loaded). Builds them first if need be. The build's outcome only: decoder/fused.py's
    `status` runs the CUDA kernels' self-check first, which may refuse them."""
    available()
    return {"cpu": _state["ok"], "cuda": bool(_state.get("cuda")), "cpu_why": _state.get("cpu_why", ""),
            "cuda_why": _state.get("cuda_why", ""), "cpu_isa": kernel_isa() if _state["ok"] else ""}


# The ISA cap of our own kernels: the widest variant every MULTIVERSION kernel (and the
# hand-written int8 and F16C ones) may run, read once by the library (csrc/multiversion.h),
# so an AVX2-capped benchmark runs our code on AVX2 too. Values: the levels, narrowest first.
ISA_CAP = "DECODER_MAX_CPU_ISA"
ISA_LEVELS = ("default", "avx2", "avx512")


def kernel_isa() -> str:
    """The variant our CPU kernels run here: "avx512", "avx2" or "default" (baseline x86-64,
    also on a CPU that is not x86): this CPU's widest under DECODER_MAX_CPU_ISA."""
    if "isa" not in _state:
        _state["isa"] = torch.ops.decoder_ops.kernel_isa()
    return _state["isa"]


def check_isa_cap(env=os.environ) -> str | None:
    """A warning line for a DECODER_MAX_CPU_ISA the library does not know (it then caps
    nothing), or None. A warning, not an error: the variable is read by every process
    that loads the ops (tests, the bench, the container), where a typo should cost the
    cap, never the decode."""
    value = env.get(ISA_CAP, "")
    if not value or value.lower() in ISA_LEVELS:
        return None
    return (f"warning: {ISA_CAP}={value!r} is not one of {', '.join(ISA_LEVELS)}; "
            "the fused C++ ops run this CPU's widest ISA")


def _reason(e: Exception) -> str:
    """One short line for why a build failed: the compiler's first error, not torch's
    'Error building extension' with the whole ninja log behind it."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
    line = next((x for x in lines if "error:" in x), lines[0])
    return re.sub(r"^\S*/", "", line)[:160]  # '/path/fused_cpu.cpp:109:28: error: ...' by its file name


def _build() -> bool:
    if os.environ.get("DECODER_NO_CPP_OPS"):
        _state["cpu_why"] = _state["cuda_why"] = "off: DECODER_NO_CPP_OPS"
        return False
    prebuilt = os.environ.get("DECODER_OPS_LIBRARY")
    try:
        if prebuilt:
            torch.ops.load_library(prebuilt)
        else:
            build_library()
    except Exception as e:  # no compiler, no headers, an ABI mismatch: the reference path still works
        _state["cpu_why"] = ("load failed: " if prebuilt else "build failed: ") + _reason(e)
        _state["cuda_why"] = "the CPU ops are not loaded"
        print(f"warning: fused C++ ops unavailable ({_state['cpu_why']}); using the PyTorch reference",
              file=sys.stderr, flush=True)
        return False

    _register_fakes()
    if warning := check_isa_cap():
        print(warning, file=sys.stderr, flush=True)
    kernel_isa()  # the library reads its cap now, once
    if torch.cuda.is_available():
        _state["cuda"] = _build_cuda()
    else:
        _state["cuda_why"] = "no GPU"
    return True


def cuda_available() -> bool:
    """Whether the CUDA kernels (csrc/fused_cuda.cu) are loaded; False without a GPU.
    decoder/fused.py checks them against their references before using them."""
    return available() and _state.get("cuda", False)


def cuda_refused(why: str) -> None:
    """decoder/fused.py's self-check found the built CUDA kernels wrong on this GPU."""
    _state["cuda"], _state["cuda_why"] = False, why


def _build_cuda() -> bool:
    """The CUDA kernels are a library of their own, so a failed nvcc build costs
    only them (CUDA tensors then take the references), never the CPU ops."""
    from torch.utils.cpp_extension import CUDA_HOME

    from . import toolkit
    prebuilt = os.environ.get("DECODER_OPS_CUDA_LIBRARY")  # the GPU image: no nvcc in there
    if not prebuilt and CUDA_HOME is None and (home := toolkit.wheels(torch.version.cuda)):
        toolkit.use(home)  # a pip-only machine: the nvcc wheels make setup installed
    elif not prebuilt and (torch.version.cuda is None or CUDA_HOME is None):
        _state["cuda_why"] = "no nvcc (CUDA_HOME, or the nvcc wheels of make setup)"
        print(f"warning: {_state['cuda_why']} for the fused CUDA kernels; CUDA uses the PyTorch reference",
              file=sys.stderr, flush=True)
        return False
    try:
        if prebuilt:
            torch.ops.load_library(prebuilt)
        else:
            build_cuda_library()
    except Exception as e:
        _state["cuda_why"] = ("load failed: " if prebuilt else "build failed: ") + _reason(e)
        print(f"warning: fused CUDA kernels unavailable ({_state['cuda_why']}); CUDA uses the PyTorch reference",
              file=sys.stderr, flush=True)
        return False
    return True


def build_cuda_library(build_dir: str | None = None, verbose: bool = False) -> None:
    """Compile (or find cached) csrc/fused_cuda.cu with nvcc and load it; raises
    on failure. Needs the CPU library loaded first: it holds the op schemas.
    Also runs without a GPU (tools/cuda_check.py: TORCH_CUDA_ARCH_LIST names
    the targets then)."""
    from torch.utils.cpp_extension import CUDA_HOME, _get_build_directory, load
    build_dir = build_dir or _get_build_directory("decoder_ops_cuda", verbose=False)
    # torch links -L$CUDA_HOME/lib64 whenever that folder exists; toolkits laid out
    # from pip wheels keep libcudart in lib/ beside an empty lib64/
    ldflags = [f"-L{d}" for d in (os.path.join(CUDA_HOME or "", "lib"),)
               if os.path.exists(os.path.join(d, "libcudart.so"))]
    with exclusive_build(build_dir):
        load(name="decoder_ops_cuda", sources=[os.path.join(_HERE, "fused_cuda.cu")], extra_cuda_cflags=CUDA_CFLAGS,
             extra_ldflags=ldflags, build_directory=build_dir, is_python_module=False, verbose=verbose)


def _register_fakes() -> None:
    """Shapes and dtypes without computing (torch.compile, opcheck, meta tensors)."""
    @torch.library.register_fake("decoder_ops::int8_linear")
    def _(x, wq_t, w_scale, bias, relu, packed=None):
        return x.new_empty((*x.shape[:-1], wq_t.shape[1]))

    @torch.library.register_fake("decoder_ops::int8_linear_quantized")
    def _(x, wq_t, w_scale, bias, relu, packed=None):
        return (x.new_empty((*x.shape[:-1], wq_t.shape[1]), dtype=torch.int8), x.new_empty(x.shape[:-1]))

    @torch.library.register_fake("decoder_ops::int8_linear_prequantized")
    def _(xq, xs, wq_t, w_scale, bias, relu, packed=None):
        return xs.new_empty((*xq.shape[:-1], wq_t.shape[1]))

    @torch.library.register_fake("decoder_ops::int8_gemm_pack")
    def _(wq, idx=None):
        n, k = (wq.shape[0] if idx is None else idx.shape[0]), wq.shape[1]
        return wq.new_empty((gemm_packed_numel(n, k),))

    @torch.library.register_fake("decoder_ops::int8_gemm")
    def _(xq, packed, n):
        return xq.new_empty((xq.shape[0], n), dtype=torch.int32)

    @torch.library.register_fake("decoder_ops::int8_gemv")
    def _(x, wq, w_scale, w_shift, bias, relu, isa):
        return x.new_empty((*x.shape[:-1], w_scale.shape[0]))

    @torch.library.register_fake("decoder_ops::add_bias_residual_layernorm")
    def _(x, h, bias, gamma, beta, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("decoder_ops::decode_attention")
    def _(q, k, v, mask):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("decoder_ops::one_row_layer")
    def _(x, y, w, kc, vc, ck, cv, t, isa, eps, epilogue_bias):
        return torch.empty_like(x), torch.empty_like(y)

    @torch.library.register_fake("decoder_ops::decode_attention_rows")
    def _(q, k, v, rows, mask=None):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("decoder_ops::encoder_attention")
    def _(qkv, mask, heads):
        return qkv.new_empty((qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3))

    @torch.library.register_fake("decoder_ops::cross_arrange")
    def _(k, v, mask):
        B, H, S, D = k.shape
        pad = lambda n: (n + 15) // 16 * 16  # noqa: E731 (kW in csrc/fused_cpu.cpp: keys, features to whole vectors)
        return (k.new_empty((B, H, D, pad(S)), dtype=torch.float32),
                k.new_empty((B, H, S, pad(D)), dtype=torch.float32), k.new_empty((B,), dtype=torch.int64))

    @torch.library.register_fake("decoder_ops::cross_attention")
    def _(q, kt, va, lens):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("decoder_ops::ngram_block_")
    def _(logits, hist, n, vocab):
        return None

    @torch.library.register_fake("decoder_ops::argmax_rows")
    def _(logits):
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("decoder_ops::linear_argmax")
    def _(x, weight, bias, chunk):
        return x.new_empty((x.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("decoder_ops::shortlist_candidates")
    def _(src, offsets, ids, always):
        return src.new_empty((torch.library.get_ctx().new_dynamic_size(),))

    @torch.library.register_fake("decoder_ops::log_softmax_topk")
    def _(logits, scores, K, n, normalized=False):
        S = logits.shape[0] // K
        return (logits.new_empty((S, n), dtype=torch.float32),
                logits.new_empty((S, n), dtype=torch.int64))


def build_library(build_dir: str | None = None) -> str:
    """Compile (or find cached) decoder/csrc and load it; returns the .so path.

    No -march: the kernels pick their ISA at run time (csrc/multiversion.h), so a
    library built here runs on any x86-64 that runs torch."""
    from torch.utils.cpp_extension import load
    build_dir = build_dir or default_build_dir()
    so = os.path.join(build_dir, "decoder_ops.so")
    with exclusive_build(build_dir):
        if _stale(so):  # ninja decides for real; this only warns of the wait
            print("building the fused C++ ops (once, ~30 s) ...", file=sys.stderr, flush=True)
        load(name="decoder_ops", sources=[os.path.join(_HERE, f) for f in SOURCES], extra_cflags=CFLAGS,
             build_directory=build_dir, is_python_module=False, verbose=False)
    return so


@contextlib.contextmanager
def exclusive_build(build_dir: str):
    """One build in build_dir at a time across processes, and no wait on a dead one.

    torch's load() (up to 2.13) waits, forever and silently, while a file `lock` exists in
    the build folder; a build stopped half-way (Ctrl-C, a killed test run) leaves it, and
    every later process hung. Our builds first take an flock on `kit.flock`, which the kernel
    drops when its holder dies: holding it, a `lock` found is one nobody holds any more.
    A torch that flocks `lock` itself (2.14 on) keeps the file between builds: it is left be."""
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "kit.flock"), "a") as f:
        baton = os.path.join(build_dir, "lock")
        if _flock(f) and load_waits_on_lock_file() and os.path.exists(baton):
            os.remove(baton)
            print(f"removed a stale build lock ({baton}), left by a build that was stopped", file=sys.stderr,
                  flush=True)
        yield  # closing the file releases the flock


def load_waits_on_lock_file() -> bool:
    """Whether this torch's load() waits while the file `lock` exists (its FileBaton), rather
    than holding an flock on it that a dead holder drops (torch 2.14's FileLock). Removing the
    file under the latter would only break its lock: a waiter could lock a fresh file."""
    from torch.utils import cpp_extension
    return hasattr(cpp_extension, "FileBaton")


def _flock(f) -> bool:
    """Wait for an exclusive flock on f; False where there is none (another OS, some network file systems)."""
    try:
        import fcntl
        fcntl.flock(f, fcntl.LOCK_EX)
        return True
    except (ImportError, OSError):
        return False


def default_build_dir() -> str:
    """torch's extension cache, one folder per copy of csrc, torch and flags:
    a shared folder would make two checkouts (or a checkout and an installed
    copy) rebuild each other's library at every switch, since ninja sees the
    source paths change."""
    from torch.utils.cpp_extension import _get_build_directory
    key = hashlib.sha256("\0".join([_HERE, torch.__version__, *CFLAGS]).encode()).hexdigest()[:12]
    return _get_build_directory(f"decoder_ops-{key}", verbose=False)


def _stale(so: str) -> bool:
    """Whether `so` is missing or older than one of its sources or csrc's headers. Not the
    CUDA file, which it is not built from: an edit there left the CPU library "stale" for
    ever, since ninja then rebuilt nothing, and every process announced a build."""
    if not os.path.exists(so):
        return True
    inputs = [f for f in os.listdir(_HERE) if f in SOURCES or f.endswith(".h")]
    return os.path.getmtime(so) < max(os.path.getmtime(os.path.join(_HERE, f)) for f in inputs)


def _check_int8_linear(op: str, x, wq_t) -> None:
    require(wq_t.dtype == torch.int8 and wq_t.dim() == 2, lambda: f"{op}: wq_t must be int8 (in, out)")
    require(x.dim() >= 1 and x.shape[-1] == wq_t.shape[0],
            lambda: f"{op}: x has {x.shape[-1] if x.dim() else 0} features, weight expects {wq_t.shape[0]}")


def int8_linear(x, wq_t, w_scale, bias, relu: bool = False, packed=None):
    """packed: wq_t's columns as `int8_gemm_pack` (our VNNI product) lays them out, or None (`_int_mm`)."""
    require(x.dtype == torch.float32, "int8_linear: x must be float32")
    _check_int8_linear("int8_linear", x, wq_t)
    return torch.ops.decoder_ops.int8_linear(x, wq_t, w_scale, bias, relu, packed)


def int8_linear_quantized(x, wq_t, w_scale, bias, relu: bool = False, packed=None):
    require(x.dtype == torch.float32, "int8_linear: x must be float32")
    _check_int8_linear("int8_linear", x, wq_t)
    return torch.ops.decoder_ops.int8_linear_quantized(x, wq_t, w_scale, bias, relu, packed)


def int8_linear_prequantized(xq, xs, wq_t, w_scale, bias, relu: bool = False, packed=None):
    require(xq.dtype == torch.int8 and xs.dtype == torch.float32 and xq.dim() >= 1
            and xs.numel() * xq.shape[-1] == xq.numel(),
            "int8_linear_prequantized: xq must be int8 (..., K) with one float scale per row")
    _check_int8_linear("int8_linear", xq, wq_t)
    return torch.ops.decoder_ops.int8_linear_prequantized(xq, xs, wq_t, w_scale, bias, relu, packed)


def int8_gemm_pack(wq, idx=None):
    """wq (out, in) int8 (rows idx only, if given) packed for `int8_gemm` (decoder/csrc/int8_gemm.cpp)."""
    require(wq.dtype == torch.int8 and wq.dim() == 2, "int8_gemm_pack: wq must be int8 (out, in)")
    if idx is not None:  # once per batch (a shortlist's rows), CPU weights: no device sync
        require(idx.dtype == torch.long and idx.dim() == 1, "int8_gemm_pack: idx must be int64 (C,)")
        lo, hi = torch.aminmax(idx) if idx.numel() else (0, -1)
        require(int(lo) >= 0 and int(hi) < wq.shape[0],
                lambda: f"int8_gemm_pack: index {int(lo) if int(lo) < 0 else int(hi)} out of range for "
                        f"{wq.shape[0]} rows")
    return torch.ops.decoder_ops.int8_gemm_pack(wq, idx)


def int8_gemm(xq, packed, n: int):
    """xq (M, K) int8 times the packed (n, K) weights (`int8_gemm_pack`'s layout): (M, n) int32,
    exactly `torch._int_mm(xq, wq.t())`."""
    require(xq.dtype == torch.int8 and xq.dim() == 2, "int8_gemm: xq must be int8 (M, K)")
    K = xq.shape[1]
    require(packed.dtype == torch.int8 and packed.dim() == 1 and packed.numel() == gemm_packed_numel(n, K),
            lambda: f"int8_gemm: packed weights of {packed.numel()} bytes are not int8_gemm_pack's layout of "
                    f"{n} outputs x {K} features")
    return torch.ops.decoder_ops.int8_gemm(xq, packed, n)


def int8_gemm_available() -> bool:
    """Whether this CPU runs `int8_gemm` (AVX-512 VNNI)."""
    return available() and torch.ops.decoder_ops.int8_gemm_available()


def gemm_packed_numel(n: int, k: int) -> int:
    """Bytes of int8_gemm_pack's layout: (n padded to 64) x (4 shift bytes + k padded to 4)."""
    np_ = -(-n // 64) * 64
    return np_ * (4 + -(-k // 4) * 4)


GEMV_PAD, GEMV_BLOCK = 64, 4  # int8_gemv's weight layout: columns padded to 64, rows to 4 (kPad, kBlock)


def int8_gemv(x, wq, w_scale, w_shift, bias, relu: bool = False, isa: int = 2):
    require(x.dtype == torch.float32 and x.dim() >= 1, "int8_gemv: x must be float32")
    require(wq.dtype == torch.int8 and wq.dim() == 2, "int8_gemv: wq must be contiguous int8 (out, in) padded")
    K, N, (Np, Kp) = x.shape[-1], w_scale.numel(), wq.shape
    require(Kp % GEMV_PAD == 0 and K <= Kp < K + GEMV_PAD,
            lambda: f"int8_gemv: wq has {Kp} columns for {K} features, expected {K} padded to a multiple of {GEMV_PAD}")
    require(Np % GEMV_BLOCK == 0 and N <= Np < N + GEMV_BLOCK,
            lambda: f"int8_gemv: wq has {Np} rows for {N} outputs, expected them padded to a multiple of {GEMV_BLOCK}")
    require(w_shift.numel() == Np and (bias is None or bias.numel() == N),
            "int8_gemv: w_shift int32 (padded out,), bias float32 (out,)")
    return torch.ops.decoder_ops.int8_gemv(x, wq, w_scale, w_shift, bias, relu, isa)


def int8_gemv_isa(cap: int = 2) -> int:
    """The path int8_gemv takes here under the cap `cap`: 0 plain C++, 1 AVX2, 2 AVX-512 VNNI."""
    return torch.ops.decoder_ops.int8_gemv_isa(cap)
