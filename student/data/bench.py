"""Data preparation at scale: prepare, encode and the first training step on a large corpus,
with wall time and peak memory of each phase (a benchmark, not a test).

    python -m tools.synth_corpus --pairs 10000000 --out /data/synth
    python -m student.data.bench --src /data/synth/train.en --tgt /data/synth/train.de --work /data/bench

Each phase runs in its own process tree; peak RSS is sampled every 0.2 s as the sum
over the tree (the parent and its worker processes) and also read from
getrusage(RUSAGE_CHILDREN) (the largest single process). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time


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


def measure(cmd: list[str], log: str) -> dict:
    """Run cmd (stderr to log); wall seconds, peak tree RSS and peak single-process RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    peak, t0 = [0], time.time()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh)
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
        raise SystemExit(f"error: {' '.join(cmd)} failed with status {proc.returncode}; see {log}")
    single = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"wall_s": round(time.time() - t0, 1), "peak_tree_rss_gb": round(peak[0] / 1e9, 3),
            "peak_process_rss_gb": round(single / 1e9, 3) if single / 1024 > before else None,
            "stdout": out.decode().strip()}


def first_step(args) -> None:
    """The child of the train phase: the encoded corpus (built or reused), then one step."""
    from student.train.trainer import Trainer, TrainConfig, load_corpus
    import torch
    cfg = TrainConfig(out_dir=args.out, src=args.src, tgt=args.tgt, max_steps=1, eval_every=0, save_every=0,
                      test_at_end=False, preset=args.preset, vocab_size=args.vocab_size)
    os.makedirs(cfg.out_dir, exist_ok=True)
    t0 = time.time()
    corpus = load_corpus(cfg, False)
    t1 = time.time()
    trainer = Trainer(cfg, corpus, torch.device("cpu"), False)
    from student.train.batching import make_batches, shard
    cfg = trainer.cfg  # with the batch sizes decided for this device
    batches = shard(make_batches(*trainer.train_lens, cfg.max_tokens, cfg.max_sentences, cfg.seed, 0), 0, 1)
    t2 = time.time()
    ntok, loss, _ = trainer.step(batches[0:1])
    t3 = time.time()
    print(json.dumps({"encode_s": round(t1 - t0, 1), "batches_s": round(t2 - t1, 1), "step_s": round(t3 - t2, 1),
                      "pairs": len(corpus.train), "batches": len(batches), "loss": round(loss, 3)}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m student.data.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--src", required=True)
    ap.add_argument("--tgt", required=True)
    ap.add_argument("--work", help="data dir and run dir go here (required)")
    ap.add_argument("--preset", default="teacher-tiny")
    ap.add_argument("--vocab-size", type=int, default=8000, help="joint SentencePiece vocabulary size")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        first_step(a)
        return 0
    if not a.work:
        ap.error("the following arguments are required: --work")
    os.makedirs(a.work, exist_ok=True)
    env_py = [sys.executable]
    log = os.path.join(a.work, "bench.log")
    data = os.path.join(a.work, "data")
    os.environ["KIT_DATA_DIR"] = data
    vocab = ["--vocab-size", str(a.vocab_size)]
    prep = measure(env_py + ["-m", "student.data", "prepare", "--src", a.src, "--tgt", a.tgt, "--data-dir", data,
                             *vocab], log)
    train = measure(env_py + ["-m", "student.data.bench", "--child", "--src", a.src, "--tgt", a.tgt,
                              "--out", os.path.join(a.work, "run"), "--preset", a.preset, *vocab], log)
    steps = json.loads(train.pop("stdout").splitlines()[-1])
    prep.pop("stdout")
    print(json.dumps({"prepare": prep, "encode_and_first_step": {**train, **steps},
                      "cores": len(os.sched_getaffinity(0))}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
