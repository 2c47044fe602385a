"""python -m student.shape_model --preset PRESET --like MODEL_DIR --out DIR [--seed 0]

A model dir of a preset's shape with random weights, and with the SentencePiece
model, languages, normaliser and lexical shortlist of an existing model dir: a
shape the kit has not trained, for timing (tools.bench, docs/bench/README.md).

Its output is noise: some sentences end early, many run to their length cap,
and every engine given the same weights does the same work. A model trained
for a step is no substitute: it ends every sentence at once, and a benchmark of
it times the encoder alone.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

from decoder import durable, fileerrors, modeldir
from decoder.cliargs import ArgumentParser, add_version, nonneg_int, run
from student.model import PRESETS, preset


def random_weights(a: modeldir.Arch, seed: int, eos: float = 2.5) -> dict[str, torch.Tensor]:
    """Random weights whose greedy outputs are varied: some sentences end early,
    some run to the length cap, tokens change from step to step. (A plain random
    initialisation ends every sentence at once: with tied embeddings the residual
    stream carries the start token, </s>, and the output layer picks it.)"""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in modeldir.tensor_shapes(a).items():
        if name.endswith("layer_norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        else:  # Xavier-like: keeps activations O(1) through the stack
            t = torch.randn(shape, generator=g) * shape[-1] ** -0.5
        w[name] = t.contiguous()
    for name in list(w):
        if name.endswith("fc2.weight"):
            # cancel the mean of relu(.) so the FFN adds no input-independent
            # direction (it otherwise makes every step predict the same token)
            w[name.replace("weight", "bias")] = -w[name].sum(1) / math.sqrt(2 * math.pi)
    w["shared.weight"][1] = 0  # padding row, as nn.Embedding(padding_idx=pad) trains it
    out = "shared.weight" if a.tie_embeddings else "lm_head.weight"
    # </s> (2) often enough that early stop and the length cap both occur (at the test models' width;
    # it is also the decoder's start token, and at d 512 any factor >= 1 ends every sentence at once)
    w[out][2] *= eos
    return w


def shape_model(name: str, like: str, out: str, seed: int = 0) -> str:
    """Write the model dir `out` (see the module doc), atomically; returns its path."""
    cfg = modeldir.read_config(like)
    dims = {f: getattr(preset(name), f) for f in ("d_model", "n_heads", "ffn_dim", "encoder_layers",
                                                   "decoder_layers")}
    cfg = dataclasses.replace(cfg, arch=dataclasses.replace(cfg.arch, **dims),
                              provenance={"shape_of": name, "random_seed": seed})

    def write(tmp: str) -> None:
        with open(os.path.join(tmp, modeldir.CONFIG), "w", encoding="utf-8") as fh:
            json.dump(cfg.to_json(), fh, indent=2, ensure_ascii=False)
        save_file(random_weights(cfg.arch, seed, eos=0.25), os.path.join(tmp, modeldir.WEIGHTS),
                  metadata={"format": "pt"})
        for f in (modeldir.SPM, modeldir.SHORTLIST):
            if os.path.exists(os.path.join(like, f)):
                shutil.copyfile(os.path.join(like, f), os.path.join(tmp, f))
        modeldir.load(tmp)  # refuse to publish a dir the decoder cannot read
    return durable.write_dir(os.path.abspath(out), write)


@fileerrors.one_line
def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m student.shape_model", description=__doc__.split("\n\n")[1])
    add_version(p)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the shape")
    p.add_argument("--like", required=True, metavar="MODEL_DIR",
                   help="model dir whose tokenizer, languages, normaliser and shortlist it takes")
    p.add_argument("--out", required=True, metavar="DIR", help="model dir to write")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the random weights")
    a = p.parse_args(argv)
    if why := modeldir.replace_error(a.out):  # a model dir of ours is replaced, nothing else
        raise fileerrors.Refused(f"--out {a.out}: {why}")
    try:
        print(shape_model(a.preset, a.like, a.out, a.seed))
    except modeldir.ModelDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
