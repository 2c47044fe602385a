"""Training speed per configuration: tokens/s of the trainer's steps, side by side in one run.

    python -m student.train.speed [--preset teacher-tiny] [--steps 24] [--threads 2]
                                [--configs fp32,bf16] [--batches 3072,auto] [--device cpu|cuda]
                                [--out docs/bench/training/training-speed.json]

Each configuration trains the same model from the same seed on the same batches
(the prepared default corpus, or the corpus `student.train` would use) for
--steps optimizer steps; the first --warm steps are not timed (allocator,
oneDNN primitive caches). Configurations run interleaved, --passes times, and
the fastest pass counts (the machine may be shared). The loss after the last
step is printed beside each rate, since a fast step that learns differently
is no gain. --batches times each configuration at several batch sizes (padded
tokens a step; `auto` = the size the trainer picks on this device,
student/train/sizing.py): the measurement behind the GPU batch ceiling. The
machine line comes from decoder.machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch

from decoder import cliargs, durable, fileerrors, machine
from student.train.batching import make_batches
from student.train.trainer import Corpus, TrainConfig, Trainer

# name -> (TrainConfig fields, the speed tool's own switches): each is one of the trainer's speed
# switches alone. The tool's own are measured here before they become trainer switches, kept only if
# they pay: "compile" (torch.compile), "no_cudnn" (CUDA: SDPA without cuDNN's attention, which builds
# an execution plan per new (batch, length) shape, reported at 0.4-0.5 s each way; length-bucketed
# batches are new shapes all through a first epoch, which ran at a fifth of the later epochs'
# tokens/s on the H200; with --passes 1, as a second pass finds the first one's plans cached).
CONFIGS = {
    "fp32": ({"amp": "off"}, ()),
    "bf16": ({"amp": "bf16"}, ()),
    "fp32+compile": ({"amp": "off"}, ("compile",)),
    "bf16+compile": ({"amp": "bf16"}, ("compile",)),
    "bf16+no_cudnn": ({"amp": "bf16"}, ("no_cudnn",)),
}


def attention_backends(device: str, switches) -> list | None:
    """The SDPA backends a configuration's steps may use (None: torch's own choice): with
    "no_cudnn" on CUDA, all but cuDNN's, in torch's order (memory-efficient attention is the one
    that takes the trainer's padding mask); CPUs have no cuDNN attention."""
    if device != "cuda" or "no_cudnn" not in switches:
        return None
    from torch.nn.attention import SDPBackend
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def run(cfg: TrainConfig, corpus: Corpus, steps: int, warm: int, switches=(), device: str = "cpu") -> dict:
    """Train `steps` steps from scratch; tokens/s over the steps after `warm`, and the seconds a
    step of the first `warm`, which meet their shapes first (caches, plans: what a new shape costs).
    The process's first row also pays its CUDA start-up there: compare warm columns from the second."""
    t = Trainer(cfg, corpus, torch.device(device), ddp=False)
    if "compile" in switches:  # batches vary in shape: dynamic shapes, or it recompiles per bucket
        t.net = torch.compile(t.model, dynamic=True)
    backends = attention_backends(device, switches)
    if backends is None:
        return timed(t, steps, warm, device)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backends):  # a global setting, restored after; the backward follows the forward
        return timed(t, steps, warm, device)


def timed(t: Trainer, steps: int, warm: int, device: str) -> dict:
    t.model.train()
    c = t.cfg  # the sizes the trainer resolved for the device
    batches = make_batches(*t.train_lens, c.max_tokens, c.max_sentences, c.seed, 0)
    tok, t0 = 0, None
    start = time.perf_counter()
    for i in range(steps):  # Trainer.step alone: its schedule advances itself, nothing else is needed
        if i == warm:
            t0 = time.perf_counter()  # each step reads its loss: the steps before have finished
        ntok, loss, _ = t.step(batches[i % len(batches): i % len(batches) + 1])
        if i >= warm:
            tok += ntok
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"tokens_s": tok / dt, "s_per_step": dt / (steps - warm),
            "warm_s_per_step": (t0 - start) / warm if warm else None, "loss": loss, "max_tokens": t.cfg.max_tokens}


def batch_list(text: str) -> list[int | None]:
    """--batches: comma-separated token budgets; `auto` (None) is the trainer's device default."""
    out = []
    for x in text.split(","):
        x = x.strip()
        if x != "auto" and not (x.isdigit() and int(x) > 0):
            raise argparse.ArgumentTypeError(f"expected positive token counts or 'auto', got {x!r}")
        out.append(None if x == "auto" else int(x))
    return out


@fileerrors.one_line
def main(argv=None):
    p = cliargs.ArgumentParser(prog="python -m student.train.speed", description=__doc__.split("\n")[0])
    cliargs.add_version(p)
    p.add_argument("--preset", default="teacher-tiny", help="model preset (student.model)")
    p.add_argument("--steps", type=cliargs.positive_int, default=24, help="steps per configuration and pass")
    p.add_argument("--warm", type=cliargs.nonneg_int, default=4, help="leading steps left out of the timing")
    p.add_argument("--passes", type=cliargs.positive_int, default=2, help="interleaved passes; the fastest counts")
    p.add_argument("--threads", type=cliargs.int_range(1, cliargs.MAX_THREADS), default=os.cpu_count(),
                   help="torch intra-op threads")
    p.add_argument("--configs", default="fp32,bf16", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--batches", type=batch_list, default=[3072],
                   help="padded tokens a step, comma-separated; 'auto' = the trainer's default on --device")
    p.add_argument("--max-batch-tokens", type=cliargs.positive_int, help="one batch size (the same as --batches N)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", help="append the result as JSON to this file")
    a = p.parse_args(argv)
    names = a.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        p.error(f"unknown configuration {bad[0]!r}; choose from {', '.join(CONFIGS)}")
    if a.warm >= a.steps:  # no step would be timed
        p.error(f"--warm {a.warm} leaves none of --steps {a.steps} to time")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    batches = [a.max_batch_tokens] if a.max_batch_tokens else a.batches
    torch.set_num_threads(a.threads)
    hw = machine.describe()
    print(machine.one_line(hw), file=sys.stderr)
    best = measure(a, names, batches)
    first = next(iter(best))
    ref = best[first]["tokens_s"]
    print(f"| {a.preset}, {a.device}, {a.threads} threads | tokens a step | tokens/s | s/step | "
          f"s/step, first {a.warm} | x {first} | loss after {a.steps} |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n, r in best.items():
        warm = "" if r["warm_s_per_step"] is None else f"{r['warm_s_per_step']:.2f}"
        print(f"| {n} | {r['max_tokens']:,} | {r['tokens_s']:,.0f} | {r['s_per_step']:.2f} | {warm} "
              f"| {r['tokens_s'] / ref:.2f} | {r['loss']:.3f} |")
    if a.out:
        row = {"preset": a.preset, "threads": a.threads, "steps": a.steps, "device": a.device, "machine": hw,
               "date": time.strftime("%Y-%m-%d"), "results": best}
        old = json.loads(open(a.out).read()) if os.path.exists(a.out) else []
        durable.write_json(a.out, old + [row])


def measure(a, names: list[str], batches: list[int | None]) -> dict[str, dict]:
    """{row name: the fastest pass}, a row per configuration and batch size, passes interleaved."""
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = TrainConfig(out_dir=tmp, preset=a.preset, eval_every=0, save_every=0, test_at_end=False)
        corpus = Corpus(base, verbose=False)
        for _ in range(a.passes):
            for n in names:
                for b in batches:
                    fields, switches = CONFIGS[n]
                    key = n if len(batches) == 1 else f"{n}, {'auto' if b is None else b} tokens"
                    cfg = dataclasses.replace(base, max_tokens=b, **fields)
                    r = run(cfg, corpus, a.steps, a.warm, switches, a.device)
                    if key not in best or r["tokens_s"] > best[key]["tokens_s"]:
                        best[key] = r
    return best


if __name__ == "__main__":
    main()
