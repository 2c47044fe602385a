"""The machine a result was measured on: every record carries it, since numbers from
different machines (or a loaded one) do not compare."""
from __future__ import annotations

import os
import platform
from importlib import metadata

import torch

from tools.machine import cpu_info, ct2_isa


def _mem_total_gb() -> float | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def describe(docker_client=None) -> dict:
    hw = cpu_info()
    hw.update(ct2_isa=ct2_isa(hw["flags"]), memory_gb=_mem_total_gb(), kernel=platform.release(),
              python=platform.python_version(), torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
              load_avg=round(os.getloadavg()[0], 2))
    hw["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    hw["versions"] = {p: _version(p) for p in ("torch", "ctranslate2", "transformers", "sacrebleu")}
    if docker_client is not None:
        hw["versions"]["docker"] = docker_client.version().get("Version")
    return hw


def one_line(hw: dict) -> str:
    gpu = f", GPU {hw['gpu']}" if hw.get("gpu") else ""
    v = ", ".join(f"{k} {x}" for k, x in hw["versions"].items() if x)
    return (f"{hw['cpu']}, {hw['cores']} cores, {hw['memory_gb']} GB RAM{gpu}; flags {' '.join(hw['flags'])}; "
            f"kernel {hw['kernel']}, Python {hw['python']}; {v}; load average {hw['load_avg']} at start")
