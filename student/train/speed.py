"""Training speed per configuration: tokens/s of the trainer's steps, side by side in one run.

    python -m student.train.speed [--preset teacher-tiny] [--steps 24] [--threads 2]
                                [--configs fp32,bf16] [--out docs/training-speed.json]

Each configuration trains the same model from the same seed on the same batches
(the prepared default corpus, or the corpus `student.train` would use) for
--steps optimizer steps; the first --warm steps are not timed (allocator,
oneDNN primitive caches). Configurations run interleaved, --passes times, and
the fastest pass counts (the machine may be shared). The loss after the last
step is printed beside each rate, since a fast step that learns differently
is no gain. The machine line comes from decoder.machine.
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

from decoder import cliargs, durable, machine
from student.train.batching import make_batches
from student.train.trainer import Corpus, TrainConfig, Trainer

# name -> (TrainConfig fields, compile the model): each is one of the trainer's speed switches alone.
# compile is measured here before it becomes a trainer switch: it is kept only if it pays.
CONFIGS = {
    "fp32": ({"amp": "off"}, False),
    "bf16": ({"amp": "bf16"}, False),
    "fp32+compile": ({"amp": "off"}, True),
    "bf16+compile": ({"amp": "bf16"}, True),
}


def run(cfg: TrainConfig, corpus: Corpus, steps: int, warm: int, compile_model: bool = False) -> dict:
    """Train `steps` steps from scratch; tokens/s over the steps after `warm`."""
    t = Trainer(cfg, corpus, torch.device("cpu"), ddp=False)
    if compile_model:  # batches vary in shape: dynamic shapes, or it recompiles per bucket
        t.net = torch.compile(t.model, dynamic=True)
    t.model.train()
    batches = make_batches(*t.train_lens, cfg.max_tokens, cfg.max_sentences, cfg.seed, 0)
    tok, t0 = 0, None
    for i in range(steps):  # Trainer.step alone: its schedule advances itself, nothing else is needed
        if i == warm:
            t0 = time.perf_counter()
        ntok, loss, _ = t.step(batches[i: i + 1])
        if i >= warm:
            tok += ntok
    dt = time.perf_counter() - t0
    return {"tokens_s": tok / dt, "s_per_step": dt / (steps - warm), "loss": loss}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cliargs.add_version(p)
    p.add_argument("--preset", default="teacher-tiny", help="model preset (student.model)")
    p.add_argument("--steps", type=int, default=24, help="steps per configuration and pass")
    p.add_argument("--warm", type=int, default=4, help="leading steps left out of the timing")
    p.add_argument("--passes", type=int, default=2, help="interleaved passes; the fastest counts")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--configs", default="fp32,bf16", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--max-batch-tokens", type=int, default=TrainConfig.max_tokens)
    p.add_argument("--out", help="append the result as JSON to this file")
    a = p.parse_args(argv)
    names = a.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        p.error(f"unknown configuration {bad[0]!r}; choose from {', '.join(CONFIGS)}")
    torch.set_num_threads(a.threads)
    hw = machine.describe()
    print(machine.one_line(hw), file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        base = TrainConfig(out_dir=tmp, preset=a.preset, max_tokens=a.max_batch_tokens, eval_every=0,
                           save_every=0, test_at_end=False)
        corpus = Corpus(base, verbose=False)
        best: dict[str, dict] = {}
        for _ in range(a.passes):
            for n in names:
                fields, compile_model = CONFIGS[n]
                r = run(dataclasses.replace(base, **fields), corpus, a.steps, a.warm, compile_model)
                if n not in best or r["tokens_s"] > best[n]["tokens_s"]:
                    best[n] = r
    ref = best[names[0]]["tokens_s"]
    print(f"| {a.preset}, {a.threads} threads | tokens/s | s/step | x {names[0]} | loss after {a.steps} |")
    print("|---|---:|---:|---:|---:|")
    for n in names:
        r = best[n]
        print(f"| {n} | {r['tokens_s']:,.0f} | {r['s_per_step']:.2f} | {r['tokens_s'] / ref:.2f} | {r['loss']:.3f} |")
    if a.out:
        row = {"preset": a.preset, "threads": a.threads, "steps": a.steps, "machine": hw,
               "date": time.strftime("%Y-%m-%d"), "results": best}
        old = json.loads(open(a.out).read()) if os.path.exists(a.out) else []
        durable.write_json(a.out, old + [row])


if __name__ == "__main__":
    main()
