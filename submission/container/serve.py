"""What /run.sh runs: the WMT modes on top of decoder.Translator.

    python -m submission.container.serve --hardware GPU|CPU-1|CPU-ALL|auto --task latency|throughput

Input is read exactly as `python -m decoder` reads it (decoder.textio: split
on b"\n" only, CRLF accepted, invalid UTF-8 replaced, each line capped at
line_cap bytes), so the container's output equals the CLI's and has one line
per input line whatever the bytes.
"""
from __future__ import annotations

import os
import sys

from decoder import cgroup


def settings(hardware: str, model_dir: str, task: str = "throughput") -> dict:
    """The Translator options of a WMT mode: everything that keeps the output
    within the BLEU bound. The lexical shortlist whenever the model dir lists
    one and has it (greedy output was identical on the KD student, 1.24-1.49x
    faster, docs/bench); on CPU the decoder's default precision (int8 where the
    CPU has an int8 kernel)."""
    s = {**hardware_settings(hardware, model_dir), "shortlist": has_shortlist(model_dir),
         "pipeline": task == "throughput"}
    if task == "latency":  # one line at a time: nothing to spread over worker threads or processes
        s.update(workers=0, max_sentences=1)
    return s


def has_shortlist(model_dir: str) -> bool:
    from decoder import modeldir
    try:
        cfg = modeldir.read_config(model_dir)
    except (modeldir.ModelDirError, OSError):
        return False  # the Translator names what is wrong with the dir
    return modeldir.has_shortlist(model_dir, cfg)


def hardware_settings(hardware: str, model_dir: str) -> dict:
    import torch
    if hardware == "auto":
        hardware = "GPU" if torch.cuda.is_available() else "CPU-ALL"
    if hardware == "GPU":
        if torch.cuda.is_available():
            return dict(device="cuda", precision="fp16", threads=1, workers=0)
        print("warning: GPU requested but CUDA is not visible; running as CPU-ALL",
              file=sys.stderr, flush=True)
        hardware = "CPU-ALL"
    # CPU precision None: the decoder's default, int8 where this CPU has an int8
    # kernel, else fp32 (decoder/translator.py default_precision).
    # CPU-ALL throughput: one pinned single-thread worker process per core, fed
    # whole batches (decoder/workers.py); 1.2-1.4x faster than one process with
    # a thread per core on 2 cores (docs/container.md), as long as the cgroup's
    # memory holds a model copy per worker (decoder/cgroup.py). Latency has
    # one sentence at a time, nothing to spread over processes: threads.
    if hardware == "CPU-1":
        return dict(device="cpu", precision=None, threads=1, workers=0)
    cores = cgroup.usable_cores()
    workers = cgroup.workers_that_fit(cores, cgroup.memory_limit(), cgroup.model_bytes(model_dir))
    return dict(device="cpu", precision=None, threads=cores, workers=workers)


def main(argv=None) -> int:
    from decoder import lifecycle
    closed = lifecycle.standard_streams()  # first: before any file takes a closed stream's descriptor
    from decoder.cliargs import ArgumentParser, add_version
    ap = ArgumentParser(prog="python -m submission.container.serve", description=__doc__.splitlines()[0])
    add_version(ap)
    ap.add_argument("--hardware", default="auto", choices=["auto", "GPU", "CPU-1", "CPU-ALL"])
    ap.add_argument("--task", default="throughput", choices=["latency", "throughput"])
    ap.add_argument("--model", default=os.environ.get("MODEL_DIR", "/model"))
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no stderr line saying the precision, threads and ISA that run")
    a = ap.parse_args(argv)
    error = lifecycle.closed_error(closed, stdin=True, stdout=True)
    if error:
        print(error, file=sys.stderr)
        return 2

    from decoder.textio import line_cap, read_lines  # the CLI's reader: same lines, same bytes
    from decoder.modeldir import ModelDirError
    from decoder.translator import Translator
    s = settings(a.hardware, a.model, a.task)
    try:
        tr = Translator(a.model, **s)
    except (ModelDirError, ValueError) as e:
        print(f"error: cannot load model: {e}", file=sys.stderr, flush=True)
        return 2
    if not a.quiet:
        from decoder.runtime import describe
        print(describe(tr, s["precision"]), file=sys.stderr, flush=True)

    with tr:
        try:
            _serve(tr, a.task, read_lines(sys.stdin.buffer, max_bytes=line_cap(tr.cfg.arch.max_positions)))
        except RuntimeError as e:  # `docker run --pids-limit` too low even for one process
            if not lifecycle.thread_refused(e):
                raise
            print(lifecycle.thread_refused(e), file=sys.stderr, flush=True)
            return 1
    return 0


def _serve(tr, task: str, lines) -> None:
    out = sys.stdout.buffer
    if task == "latency":
        for line in lines:
            out.write(tr.translate([line])[0].encode("utf-8") + b"\n")
            out.flush()  # the next line is written only after this answer is read
    else:
        # translate_stream reads, sorts and batches chunk_lines lines at a time:
        # memory is bounded by the chunk, not by the input.
        for hyp in tr.translate_stream(lines):
            out.write(hyp.encode("utf-8") + b"\n")
        out.flush()


if __name__ == "__main__":
    # at once: as PID 1 (run.sh execs this) Python has no default action for SIGTERM,
    # and `docker stop` would wait its full timeout (decoder/lifecycle.py)
    from decoder.lifecycle import stop_on_signals
    stop_on_signals()
    from decoder.cliargs import run
    sys.exit(run(main))
