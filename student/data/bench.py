"""Data preparation at scale: prepare, encode and the first training step on a large corpus,
with wall time and peak memory of each phase (a benchmark, not a test).

    python -m tools.synth_corpus --pairs 10000000 --out /data/synth
    python -m student.data.bench --src /data/synth/train.en --tgt /data/synth/train.de --work /data/bench

Each phase runs in its own process tree; peak RSS is sampled every 0.2 s as the sum
over the tree (the parent and its worker processes) and also read from
getrusage(RUSAGE_CHILDREN) (the largest single process). Prints one JSON object.

With --ranks R (2: the issue's target), two more phases on the same prepared corpus:
R torchrun processes (gloo on CPU) encode the train split afresh and take --steps
DDP steps, and one process (reusing the one-process encoding) takes the steps R ranks
take (ranks.replica_steps): rank r's batches r, r + R, ... of the one-process batch
list, each rank's loss normalised by its own tokens, the gradients averaged. Both on one
thread a process (torchrun's default), so equal means bit-equal. The JSON's "ranks"
says whether the encoded shards are byte-identical (sha256 of the shard files), the
losses equal step by step and rank by rank, and the parameters after the steps equal
(sha256 of the state dict; the largest difference), with the phase's wall and peak RSS.

With --shortlist, the first step's model is written to a model dir and the shortlist of the
whole prepared train split is built into it (python -m student.shortlist), timed the same way.

With --speedup, only prepare, twice on the same corpus, each into a data dir of its own: once
pinned to one core (as `taskset -c` would: its workers inherit the pin) and once on every usable
core. The JSON gives both phases, the ratio of their wall times and whether the two prepared
dirs hold the same bytes (every file but spm.model, whose trainer spec names a temp path;
spm.vocab holds every piece and score it learned). The machine (decoder/machine.py) heads
every report.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

from decoder import fileerrors, machine
from decoder.cliargs import ArgumentParser, add_version, positive_int
from student.data import indexed


def tree_rss(pid: int) -> int:
    """Resident bytes of pid and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def measure(cmd: list[str], log: str, env: dict | None = None, cores: set[int] | None = None) -> dict:
    """Run cmd (stderr to log), on `cores` if given; wall seconds, peak tree RSS and peak
    single-process RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    peak, t0 = [0], time.time()
    start = os.path.getsize(log) if os.path.exists(log) else 0
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh, env=env, preexec_fn=pin)
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss(proc.pid))
                done.wait(0.2)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        out = proc.communicate()[0]
        done.set()
        th.join()
    if proc.returncode:
        why = phase_error(log, start) or f"{' '.join(cmd)} failed with status {proc.returncode}"
        raise SystemExit(f"error: {why} (the phase's log: {log})")
    single = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"wall_s": round(time.time() - t0, 1), "peak_tree_rss_gb": round(peak[0] / 1e9, 3),
            "peak_process_rss_gb": round(single / 1e9, 3) if single / 1024 > before else None,
            "stdout": out.decode().strip()}


def phase_error(log: str, start: int) -> str | None:
    """The failed phase's own last `error:` line (what its user would have seen), from its part
    of the log, so the benchmark's one error line says why and not only which command."""
    with open(log, "rb") as fh:
        fh.seek(start)
        lines = fh.read().decode(errors="replace").replace("\r", "\n").splitlines()
    said = [x.strip() for x in lines if x.strip().startswith("error:")]
    return said[-1].removeprefix("error:").strip() if said else None


def first_step(a) -> None:
    """The child of the train phase: the encoded corpus (built or reused), then one step."""
    from student.train.trainer import Trainer, load_corpus
    from student.data.ranks import train_config
    from student.train.batching import make_batches, shard
    import torch
    cfg = train_config(a)
    os.makedirs(cfg.out_dir, exist_ok=True)
    t0 = time.time()
    corpus = load_corpus(cfg, False)
    t1 = time.time()
    trainer = Trainer(cfg, corpus, torch.device("cpu"), False)
    c = trainer.cfg  # the batch sizes resolved for this machine
    batches = shard(make_batches(*trainer.train_lens, c.max_tokens, c.max_sentences, c.seed, 0), 0, 1)
    t2 = time.time()
    ntok, loss, _ = trainer.step(batches[0:1])
    t3 = time.time()
    model = None
    if a.shortlist:  # a model dir for the shortlist phase: the model after its step
        from student.modeldir import write_model_dir
        model = write_model_dir(trainer.model, trainer.meta["spm_model"], os.path.join(cfg.out_dir, "model"),
                                trainer.meta)
    print(json.dumps({"encode_s": round(t1 - t0, 1), "batches_s": round(t2 - t1, 1), "step_s": round(t3 - t2, 1),
                      "pairs": len(corpus.train), "batches": len(batches), "loss": round(loss, 3),
                      "model": model, "train": corpus.prep.splits["train"]}))


def parse_args(argv=None):
    ap = ArgumentParser(prog="python -m student.data.bench", description=__doc__.split("\n\n")[0])
    add_version(ap)
    ap.add_argument("--src", required=True, help="source side of the corpus, one sentence a line")
    ap.add_argument("--tgt", required=True, help="target side, line-aligned with --src")
    ap.add_argument("--work", help="data dir and run dirs go here (required)")
    ap.add_argument("--preset", default="teacher-tiny", help="the model preset the training phases build")
    ap.add_argument("--vocab-size", type=positive_int, default=8000, help="SentencePiece vocabulary (prepare's)")
    ap.add_argument("--max-tokens", type=positive_int,
                    help="tokens a batch; unset, the trainer's choice for the machine")
    ap.add_argument("--ranks", type=positive_int, default=1,
                    help="also run encoding and --steps training steps under torchrun with this many gloo "
                         "processes, against one process taking the same steps (1 = no)")
    ap.add_argument("--steps", type=positive_int, default=3, help="training steps compared under --ranks")
    ap.add_argument("--shard-pairs", type=positive_int, default=indexed.SHARD,
                    help="pairs a shard of the encoded corpus (ranks encode shards i %% R == r)")
    ap.add_argument("--shortlist", action="store_true",
                    help="also build the shortlist of the prepared train split into the first step's model dir")
    ap.add_argument("--speedup", action="store_true",
                    help="only prepare, pinned to one core and on every usable core: the ratio, and "
                         "whether the outputs are byte-identical")
    ap.add_argument("--child", choices=("first", "replicas", "ddp"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.child and not a.work:
        ap.error("the following arguments are required: --work")
    return a


@fileerrors.one_line
def main(argv=None) -> int:
    a = parse_args(argv)
    for path in (a.src, a.tgt):
        if not os.path.isfile(path):
            print(f"error: {path}: no such file", file=sys.stderr)
            return 2
    if a.child:
        from student.data import ranks
        indexed.SHARD = a.shard_pairs  # the children encode
        {"first": first_step, "replicas": ranks.one_process, "ddp": ranks.ddp}[a.child](a)
        return 0
    os.makedirs(a.work, exist_ok=True)
    log = os.path.join(a.work, "bench.log")
    data = os.path.join(a.work, "data")
    os.environ["KIT_DATA_DIR"] = data
    out = {"machine": machine.describe(), "cores": len(os.sched_getaffinity(0))}
    if a.speedup:
        print(json.dumps({**out, **speedup_phase(a, log)}, indent=2))
        return 0
    prep = measure(prepare_cmd(a, data), log)
    train = measure(child(a, "first", os.path.join(a.work, "run")), log)
    steps = json.loads(train.pop("stdout").splitlines()[-1])
    prep.pop("stdout")
    out.update(prepare=prep, encode_and_first_step={**train, **steps})
    if a.shortlist:
        out["shortlist"] = measure([sys.executable, "-m", "student.shortlist", "--model", steps["model"],
                                    "--src", steps["train"][0], "--tgt", steps["train"][1]], log)
        out["shortlist"].update(json.loads(out["shortlist"].pop("stdout").splitlines()[-1]))
    if a.ranks > 1:
        out["ranks"] = ranks_phase(a, log)
    print(json.dumps(out, indent=2))
    return 0


def prepare_cmd(a, data: str) -> list[str]:
    return [sys.executable, "-m", "student.data", "prepare", "--src", a.src, "--tgt", a.tgt,
            "--data-dir", data, "--vocab-size", str(a.vocab_size)]


def speedup_phase(a, log: str) -> dict:
    """prepare pinned to one core, then on every usable core, each into a fresh data dir."""
    runs = {}
    for name, cores in (("one_core", {min(os.sched_getaffinity(0))}), ("all_cores", None)):
        data = os.path.join(a.work, f"data-{name}")
        shutil.rmtree(data, ignore_errors=True)  # a cache hit would time nothing
        runs[name] = measure(prepare_cmd(a, data), log, cores=cores)
        runs[name]["digest"] = prepared_digest(runs[name].pop("stdout").splitlines()[-1])
    one, all_ = runs["one_core"], runs["all_cores"]
    return {**runs, "speedup": round(one["wall_s"] / all_["wall_s"], 2), "identical": one["digest"] == all_["digest"]}


def prepared_digest(prepared: str) -> str:
    """sha256 over a prepared dir's files, names and bytes, but spm.model (its trainer spec names
    the temp path it was trained in; spm.vocab holds every piece and score it learned)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(prepared)):
        if name != "spm.model":
            h.update(name.encode() + b"\0")
            with open(os.path.join(prepared, name), "rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def child(a, kind: str, out: str, dump: str | None = None) -> list[str]:
    """The command line of a child phase of this benchmark."""
    cmd = ["-m", "student.data.bench", "--child", kind, "--src", a.src, "--tgt", a.tgt, "--out", out,
           "--preset", a.preset, "--vocab-size", str(a.vocab_size), "--ranks", str(a.ranks), "--steps", str(a.steps),
           "--shard-pairs", str(a.shard_pairs)]
    cmd += ["--max-tokens", str(a.max_tokens)] if a.max_tokens else []
    cmd += ["--shortlist"] if a.shortlist else []
    cmd += ["--dump", dump] if dump else []
    if kind == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.ranks),
                *cmd]
    return [sys.executable, *cmd]


def ranks_phase(a, log: str) -> dict:
    """--ranks R processes against one: the same shards, losses and parameters (module docstring)."""
    from student.data import ranks
    env = dict(os.environ, OMP_NUM_THREADS="1")  # torchrun's default for each of several ranks
    one = measure(child(a, "replicas", os.path.join(a.work, "run"), os.path.join(a.work, "params-1")), log, env)
    run = os.path.join(a.work, f"run-ranks{a.ranks}")
    shutil.rmtree(run, ignore_errors=True)  # encoded afresh by the ranks, not reused
    many = measure(child(a, "ddp", run, os.path.join(a.work, f"params-{a.ranks}")), log, env)
    ref, got = (json.loads(x.pop("stdout").splitlines()[-1]) for x in (one, many))
    return {"world": a.ranks, "steps": a.steps, **ranks.compare(ref, got), "one_process": {**one, **ref},
            f"{a.ranks}_ranks": {**many, **got}}


if __name__ == "__main__":
    sys.exit(main())
