"""The CPU a number was measured on: model, cores and the ISA flags that decide speed."""
from __future__ import annotations

import os
import platform

FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_info() -> dict:
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def ct2_isa(flags: list[str]) -> str:
    return "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "GENERIC"
