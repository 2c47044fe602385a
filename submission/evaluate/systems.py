"""What gets measured: one `System` per engine x model dir x precision x beam x threads
(local) or per /run.sh hardware mode (the container)."""
from __future__ import annotations

import glob
import os
import sys
from dataclasses import asdict, dataclass, field

from decoder.cliargs import model_dir_error
from decoder.translator import NO_CUDA, resolve_device_precision, runs_on
from submission.container.serve import has_shortlist

ENGINES = ("decoder", "ct2", "hf")
CT2_COMPUTE = {"fp32": "float32", "int8": "int8", "bf16": "bfloat16", "fp16": "float16"}
HARDWARE = ("CPU-1", "CPU-ALL", "GPU")


class EvalError(Exception):
    """Bad input or an unusable environment: the CLI prints it as one `error:` line."""


@dataclass
class System:
    engine: str                  # decoder | ct2 | hf | container
    name: str                    # the model's name (teacher, student, ...) or the image tag
    mode: str = "throughput"     # throughput | latency (one sentence at a time)
    model_dir: str | None = None
    precision: str | None = None
    beam: int = 1
    threads: int | None = None
    device: str = "cpu"
    image: str | None = None     # container only
    hardware: str | None = None  # container only: the /run.sh argument
    cpus: float | None = None    # container only: its CPU quota
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.engine == "container":
            return f"container {self.hardware} ({self.name})" + (" latency" if self.mode == "latency" else "")
        search = "greedy" if self.beam == 1 else f"beam {self.beam}"
        engine = {"decoder": "ours", "ct2": "CT2", "hf": "HF"}[self.engine]
        dev = "" if self.device == "cpu" else f" {self.device}"
        inter = self.extra.get("workers") or self.extra.get("ct2_inter_threads", 1)
        threads = f"{inter}x{self.threads // inter}t" if inter > 1 else f"{self.threads}t"
        vocab = " shortlist" if self.extra.get("shortlist") else " vmap" if self.extra.get("ct2_vmap") else ""
        return (f"{self.name} {engine} {self.precision} {search} {threads}{dev}{vocab}"
                + (" latency" if self.mode == "latency" else ""))

    def config(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


def parse_named_dir(arg: str, flag: str = "--model") -> tuple[str, str]:
    """`NAME=DIR` or `DIR` (named after the directory, or its parent for `.../model`), given as
    `flag`; EvalError naming it where DIR's config does not read (the full check, shapes
    included, happens where each system loads it)."""
    name, sep, path = arg.partition("=")
    if not sep:
        name, path = "", arg
    if why := model_dir_error(flag, path):
        raise EvalError(why)
    path = os.path.abspath(path)
    if not name:
        name = os.path.basename(path)
        if name == "model":  # runs/<run>/student-<key>/model: the parent says what it is
            name = os.path.basename(os.path.dirname(path))
    return name, path


def default_models(root: str) -> list[tuple[str, str]]:
    """Every `runs/<run>/{teacher,student,baseline}-model` that `make distill` linked."""
    found = []
    for role in ("teacher", "student", "baseline"):
        for link in sorted(glob.glob(os.path.join(root, "runs", "*", f"{role}-model"))):
            if os.path.isfile(os.path.join(link, "model.safetensors")):
                run = os.path.basename(os.path.dirname(link))
                found.append((f"{run}/{role}", os.path.abspath(link)))
    return found


def grid(models: list[tuple[str, str]], engines: list[str], precisions: list[str], beams: list[int],
         threads: list[int], modes: list[str], device: str = "cpu") -> list[System]:
    """Every combination. HF runs fp32 only (it has no int8 path on our weights), once per
    beam/threads; precisions a device cannot run are left out rather than failing the run."""
    out = []
    for engine in engines:
        if engine not in ENGINES:
            raise EvalError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    if runs_on(device) != device:  # once, not once a row
        print(NO_CUDA, file=sys.stderr, flush=True)
    for name, path in models:
        for engine in engines:
            precs = ["fp32"] if engine == "hf" else precisions
            seen = set()
            for prec in precs:
                try:
                    dev, prec = resolve_device_precision(device, prec, warn=False)
                except ValueError:
                    continue
                if engine == "hf":
                    dev = "cpu"
                for beam in beams:
                    for t in threads:
                        for mode in modes:
                            key = (prec, beam, t, mode, dev)
                            if key in seen:
                                continue
                            seen.add(key)
                            extra = LAYOUT.get(engine, lambda *a: {})(mode, t, dev)
                            out.append(System(engine, name, mode, path, prec, beam, t, dev, extra=extra))
                            # a model dir's lexical shortlist: our row with it beside CT2's with its
                            # vocabulary map built from it (each engine's own best, as tools.bench)
                            if engine in VOCAB_SWITCH and has_shortlist(path):
                                out.append(System(engine, name, mode, path, prec, beam, t, dev,
                                                  extra={**extra, VOCAB_SWITCH[engine]: True}))
    return out


VOCAB_SWITCH = {"decoder": "shortlist", "ct2": "ct2_vmap"}


def ct2_layout(mode: str, threads: int, device: str) -> dict:
    """CTranslate2's performance guide: for throughput on CPU, one worker per core
    (inter_threads = cores, intra_threads = 1), each on its own sub-batch; one
    sentence at a time (latency) can only use threads inside one worker."""
    if mode == "throughput" and device == "cpu" and threads > 1:
        return {"ct2_inter_threads": threads, "ct2_intra_threads": 1}
    return {"ct2_inter_threads": 1, "ct2_intra_threads": threads}


def decoder_layout(mode: str, threads: int, device: str) -> dict:
    """Ours as the container's CPU-ALL mode runs it (submission/container/serve.py): for
    throughput on CPU one pinned 1-thread worker process per core; latency one process."""
    if mode == "throughput" and device == "cpu" and threads > 1:
        return {"workers": threads}
    return {}


LAYOUT = {"ct2": ct2_layout, "decoder": decoder_layout}


def container_systems(image: str, name: str, hardware: list[str], modes: list[str],
                      all_cpus: float) -> list[System]:
    out = []
    for hw in hardware:
        if hw not in HARDWARE:
            raise EvalError(f"unknown container hardware {hw!r} (choose from {', '.join(HARDWARE)})")
        for mode in modes:
            out.append(System("container", name, mode, image=image, hardware=hw,
                              cpus=1.0 if hw == "CPU-1" else all_cpus))
    return out
