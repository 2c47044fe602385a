"""The machine a result was measured on (decoder/machine.py), with what only the
evaluation needs: the load average at start and the docker daemon's version.
Every record carries it, since numbers from different machines (or a loaded one)
do not compare."""
from __future__ import annotations

import os

from decoder import machine
from decoder.machine import one_line

__all__ = ["describe", "one_line"]


def describe(docker_client=None) -> dict:
    hw = machine.describe(packages=("torch", "ctranslate2", "transformers", "sacrebleu"))
    hw["load_avg"] = round(os.getloadavg()[0], 2)
    if docker_client is not None:
        hw["versions"]["docker"] = docker_client.version().get("Version")
    return hw
