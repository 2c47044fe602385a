"""The machine a number was measured on: CPU model, the ISA flags that decide speed,
cores, threads, memory and the versions that ran. The one reader of /proc/cpuinfo
and /proc/meminfo for the trainer, the distill report, the benches and the
evaluation: numbers from different machines do not compare, so each carries this."""
from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata

# The flags that pick kernels: AVX2/FMA is the floor of every fast path, AVX-512 and
# VNNI speed int8, AVX512-BF16/AMX make bf16 native rather than emulated.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
PACKAGES = ("torch", "ctranslate2")


def parse_cpuinfo(text: str) -> dict:
    """{cpu, cores, threads, flags} from /proc/cpuinfo's text. cores: distinct
    (physical id, core id) pairs, the logical CPUs where those are missing (VMs)."""
    model, flags, cores, threads = None, set(), set(), 0
    for block in text.split("\n\n"):
        kv = {}
        for line in block.splitlines():
            k, sep, v = line.partition(":")
            if sep:
                kv[k.strip()] = v.strip()
        if "processor" not in kv:
            continue
        threads += 1
        model = model or kv.get("model name")
        flags |= set(kv.get("flags", "").split())
        if "core id" in kv:
            cores.add((kv.get("physical id", "0"), kv["core id"]))
    return {"cpu": model or platform.processor() or platform.machine() or "unknown",
            "cores": len(cores) or threads or None, "threads": threads or None,
            "flags": [f for f in ISA_FLAGS if f in flags]}


def parse_meminfo(text: str) -> float | None:
    """MemTotal in GiB (one decimal), None if absent."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)  # the kernel writes kB (KiB)
    return None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """{cpu, cores, threads, flags}; threads falls back to os.cpu_count() off Linux."""
    info = parse_cpuinfo(_read(cpuinfo))
    info["threads"] = info["threads"] or os.cpu_count()
    info["cores"] = info["cores"] or info["threads"]
    return info


def has_native_bf16(flags: list[str]) -> bool:
    """AVX512-BF16 or AMX: without either, bf16 is emulated and slower than fp32."""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def ct2_isa(flags: list[str]) -> str:
    """The CT2_FORCE_CPU_ISA value for the best ISA these flags allow."""
    return "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "GENERIC"


def isa(flags: list[str]) -> str:
    """The widest vector ISA, as a person would name it: AMX, AVX-512(+VNNI+BF16), AVX2."""
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "+".join(["AVX-512"] + [x for f, x in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")) if f in flags])
    return "AVX2" if "avx2" in flags else "generic x86-64" if platform.machine() == "x86_64" else platform.machine()


def version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)  # not imported: ctranslate2 may not load everywhere
    except metadata.PackageNotFoundError:
        return None


def device_kind() -> str:
    """cuda where torch sees a GPU, else cpu: where a job runs that is not told (`make distill`'s
    defaults and teachers, its report)."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def describe(packages=PACKAGES, cpuinfo: str = "/proc/cpuinfo", meminfo: str = "/proc/meminfo") -> dict:
    """Everything above, plus usable threads (this process's affinity), memory, GPU,
    kernel, Python, torch's CPU capability, package versions and today's UTC date."""
    import torch
    hw = cpu_info(cpuinfo)
    hw.update(usable_threads=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else hw["threads"],
              isa=isa(hw["flags"]), ct2_isa=ct2_isa(hw["flags"]), memory_gb=parse_meminfo(_read(meminfo)),
              gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              kernel=platform.release(), python=platform.python_version(),
              torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
              date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              versions={p: version(p) for p in packages})
    return hw


def one_line(hw: dict) -> str:
    """`AMD EPYC (AVX2; avx2 fma), 2 cores / 2 threads, 23.5 GB RAM; torch 2.5.1, ctranslate2 4.5.0; 2026-11-24`"""
    gpu = f", GPU {hw['gpu']}" if hw.get("gpu") else ""
    mem = f", {hw['memory_gb']} GB RAM" if hw.get("memory_gb") else ""
    v = ", ".join(f"{k} {x}" for k, x in (hw.get("versions") or {}).items() if x)
    return (f"{hw['cpu']} ({hw.get('isa') or isa(hw['flags'])}; {' '.join(hw['flags']) or 'no AVX2'}), "
            f"{hw['cores']} cores / {hw['threads']} threads{mem}{gpu}" + (f"; {v}" if v else "")
            + (f"; {hw['date']}" if hw.get("date") else ""))
