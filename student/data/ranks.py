"""Several torchrun ranks against one process: the benchmark's check that a DDP run reads the
same data and takes the same first steps (student/data/bench.py --ranks).

DDP does not take the steps of one process with accumulation: each rank normalises
its loss by its own batch's tokens and the gradients are averaged, where one process
would normalise by the tokens of all the batches. So the one-process side takes the
steps as the ranks do (replica_steps), and equal results say that each rank read its
own batches (r, r + R, ... of the one-process list) from identically encoded shards
and that the all-reduce did what it should.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import torch


def replica_steps(trainer, batches, world: int, n: int) -> list[list[float]]:
    """n optimizer steps as `world` DDP ranks take them, in this process: step k's batch of rank r
    is batches[k * world + r], its gradient normalised by its own tokens (Trainer.backward) and
    divided by world before the sum over ranks (DDP's averaging all-reduce), then one update.
    Each rank draws its dropout from its own generator, seeded as every rank's is.
    Returns the losses [step][rank]."""
    params = list(trainer.model.parameters())
    rngs = [torch.get_rng_state()] * world  # each rank's, as its Trainer left it
    losses = []
    for k in range(n):
        total = [None] * len(params)
        row = []
        for r in range(world):
            torch.set_rng_state(rngs[r])
            row.append(trainer.backward([batches[k * world + r]])[1])
            rngs[r] = torch.get_rng_state()
            for i, p in enumerate(params):
                if p.grad is not None:
                    g = p.grad / world
                    total[i] = g if total[i] is None else total[i] + g
            trainer.opt.zero_grad(set_to_none=True)
        for p, g in zip(params, total):
            p.grad = g
        trainer.update()
        losses.append(row)
    return losses


def params_digest(state: dict) -> str:
    """sha256 of a state dict's tensors (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def shards_digest(path: str) -> str:
    """sha256 of an encoded corpus dir's shard files (names and bytes; not meta.json, which
    holds the SentencePiece model's path)."""
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(path) if f.endswith(".npy")):
        h.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def compare(one: dict, many: dict) -> dict:
    """What the one-process and the R-rank children reported (their JSON), side by side."""
    ref = torch.load(os.path.join(one["dump"], "rank0.pt"), weights_only=True)
    got = [torch.load(os.path.join(many["dump"], f"rank{r}.pt"), weights_only=True) for r in range(many["world"])]
    diff = max((float((ref[k].double() - got[0][k].double()).abs().max()) for k in ref if ref[k].numel()), default=0.0)
    losses = [abs(a - b) for x, y in zip(one["losses"], many["losses"]) for a, b in zip(x, y)]
    return {"same_prepared_dir": one["prepared"] == many["prepared"],
            "shards_identical": one["shards_sha256"] == many["shards_sha256"],
            "losses_equal": one["losses"] == many["losses"],
            "max_loss_diff": max(losses, default=0.0),
            "params_equal": params_digest(ref) == params_digest(got[0]),
            "max_abs_param_diff": diff,
            "replicas_equal": len({params_digest(g) for g in got}) == 1}


def train_config(a):
    """The TrainConfig of a bench child (its argparse namespace)."""
    from student.train.trainer import TrainConfig
    return TrainConfig(out_dir=a.out, src=a.src, tgt=a.tgt, max_steps=1, eval_every=0, save_every=0,
                       test_at_end=False, preset=a.preset, vocab_size=a.vocab_size, max_tokens=a.max_tokens)


def _setup(a, ddp: bool):
    """(trainer, corpus, encode seconds) of a child, its corpus encoded or reused under a.out."""
    from student.train.trainer import Trainer, init_distributed, load_corpus
    device = init_distributed()[1] if ddp else torch.device("cpu")
    cfg = train_config(a)
    os.makedirs(cfg.out_dir, exist_ok=True)
    t0 = time.time()
    corpus = load_corpus(cfg, ddp)
    encode_s = time.time() - t0
    return Trainer(cfg, corpus, device, ddp), corpus, encode_s


def _batches(trainer, steps: int, world: int):
    """The first epoch's batches, the one-process list; at least steps x world of them."""
    from student.train.batching import make_batches
    c = trainer.cfg
    batches = make_batches(*trainer.train_lens, c.max_tokens, c.max_sentences, c.seed, 0)
    if len(batches) < steps * world:
        raise SystemExit(f"error: {steps} steps of {world} ranks need {steps * world} batches, the corpus "
                         f"gives {len(batches)}: fewer --steps or a smaller --max-tokens")
    return batches


def _report(a, trainer, corpus, losses, encode_s: float, steps_s: float, world: int) -> None:
    """Dump this process's parameters; rank 0 prints its JSON line."""
    os.makedirs(a.dump, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()},
               os.path.join(a.dump, f"rank{trainer.rank}.pt"))
    if trainer.rank == 0:
        print(json.dumps({"encode_s": round(encode_s, 1), "steps_s": round(steps_s, 1), "losses": losses,
                          "world": world, "dump": a.dump, "prepared": corpus.prep.dir,
                          "shards_sha256": shards_digest(corpus.train.path), "pairs": len(corpus.train)}))


def one_process(a) -> None:
    """The bench's one-process child: --steps steps as --ranks ranks take them (replica_steps)."""
    trainer, corpus, encode_s = _setup(a, ddp=False)
    batches = _batches(trainer, a.steps, a.ranks)
    t0 = time.time()
    losses = replica_steps(trainer, batches, a.ranks, a.steps)
    _report(a, trainer, corpus, losses, encode_s, time.time() - t0, 1)


def ddp(a) -> None:
    """The bench's torchrun child: each rank encodes its shards and takes --steps DDP steps."""
    import torch.distributed as dist
    from student.train.batching import shard
    trainer, corpus, encode_s = _setup(a, ddp=True)
    mine = shard(_batches(trainer, a.steps, trainer.world), trainer.rank, trainer.world)
    t0 = time.time()
    own = [trainer.step(mine[k:k + 1])[1] for k in range(a.steps)]
    steps_s = time.time() - t0
    every = [None] * trainer.world
    dist.all_gather_object(every, own)
    _report(a, trainer, corpus, [list(x) for x in zip(*every)], encode_s, steps_s, trainer.world)
    dist.barrier()
    dist.destroy_process_group()
