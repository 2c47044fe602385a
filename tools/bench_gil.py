"""How long the thread that feeds a GPU waits for the GIL while the text pipeline runs.

    python -m tools.bench_gil --model DIR --src FILE [--lines 2000] [--seconds 0.5] [--out PREFIX]

On CUDA the decoding thread replays a block of steps, then waits for the GPU
(`hostsync.item`: the GIL released) and replays the next. Meanwhile the text
pipeline's threads (decoder/pipeline.py) normalise and encode the next chunk and
detokenise finished batches: Python, holding the GIL. A thread that wants the GIL
back gets it when the holder reaches its switch interval, so each wait for the GPU
can grow by up to that interval while the GPU idles.

This runs that loop without a GPU: each block a little Python (the replay's), then
a sleep of --block-ms (the GPU's block, GIL released), for --seconds; `busy` is the
sleeps' share of the loop's wall, the GPU's share of a real pass. Rows: the loop
alone; beside a thread running the model's `Text.encode` over --lines lines again
and again, at each --intervals switch interval (decoder switch
`short_gil_interval` sets 0.2 ms while the pipeline runs). Machine-dependent:
needs a core for each thread to say anything about the GIL alone. Then one
batch's outputs read into lists two ways, in ms: the whole `tolist` (one C call
holding the GIL) against `hostsync.Later.until`.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from decoder import cliargs, hostsync, modeldir
from decoder.machine import describe, one_line
from decoder.pipeline import Text, switch_interval_of

from .bench import read


def feeder(block_s: float, seconds: float) -> float:
    """The GPU-feeding loop for `seconds`: its busy share (the blocks' time over its wall)."""
    n = max(int(seconds / block_s), 1)
    t = time.perf_counter()
    for _ in range(n):
        sum(range(32))  # the replay's Python
        time.sleep(block_s)  # the wait for the GPU's block, GIL released
    return n * block_s / (time.perf_counter() - t)


def beside_encoding(text: Text, lines: list[str], block_s: float, seconds: float) -> tuple[float, float]:
    """(busy, lines encoded per second) with a thread running text.encode(lines) meanwhile."""
    stop, done = threading.Event(), []

    def encode():
        while not stop.is_set():
            text.encode(lines)
            done.append(time.perf_counter())
    th = threading.Thread(target=encode, daemon=True)
    start = time.perf_counter()
    th.start()
    busy = feeder(block_s, seconds)
    stop.set()
    th.join()
    rate = len(done) * len(lines) / (done[-1] - start) if done else 0.0
    return busy, rate


def read_rows_ms(rows: int = 2048, T: int = 100, stop: int = 2, repeat: int = 20) -> dict:
    """A batch's outputs (rows, T) read into lists up to each row's `stop`, in ms: one `tolist` of
    the batch (one C call, the GIL held throughout) and a scan of each list, against
    `hostsync.Later.until` (a row at a time)."""
    g = torch.Generator().manual_seed(0)
    out = torch.randint(stop + 1, 8000, (rows, T), generator=g)
    out[torch.arange(rows), torch.randint(1, T, (rows,), generator=g)] = stop
    later = hostsync.later(out, "outputs")
    ways = {"tolist_ms": lambda: out.tolist(),
            "tolist_and_scan_ms": lambda: [r[:r.index(stop)] for r in out.tolist()],
            "until_ms": lambda: later.until(stop)}
    assert ways["tolist_and_scan_ms"]() == ways["until_ms"]()
    ms = {}
    for name, fn in ways.items():
        fn()
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        ms[name] = round((time.perf_counter() - t) / repeat * 1e3, 2)
    return {"rows": rows, "T": T, **ms}


def run(a) -> list[dict]:
    cfg, _, spm_path = modeldir.load(a.model)
    text = Text(cfg, spm_path, cfg.arch.max_positions)
    lines = read(a.src)[:a.lines]
    rows = []
    for block_ms in a.block_ms:
        rows.append({"block_ms": block_ms, "beside": "nothing", "interval_ms": sys.getswitchinterval() * 1e3,
                     "busy": round(feeder(block_ms / 1e3, a.seconds), 3), "encode_lines_per_s": None})
        for ms in a.intervals:
            with switch_interval_of(ms / 1e3):
                busy, rate = beside_encoding(text, lines, block_ms / 1e3, a.seconds)
            rows.append({"block_ms": block_ms, "beside": "Text.encode", "interval_ms": ms, "busy": round(busy, 3),
                         "encode_lines_per_s": round(rate)})
    return rows


def to_markdown(rows: list[dict], machine: str) -> str:
    out = [f"Machine: {machine}", "", "| GPU block (ms) | beside | switch interval (ms) | feeder busy | encode lines/s |",
           "|---:|---|---:|---:|---:|"]
    out += [f"| {r['block_ms']:g} | {r['beside']} | {r['interval_ms']:g} | {r['busy']:.0%} | "
            f"{'' if r['encode_lines_per_s'] is None else format(r['encode_lines_per_s'], ',')} |" for r in rows]
    return "\n".join(out) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = cliargs.ArgumentParser(prog="python -m tools.bench_gil", description=__doc__.split("\n\n")[0])
    cliargs.add_version(p)
    p.add_argument("--model", required=True, help="model dir (its normaliser and SentencePiece model)")
    p.add_argument("--src", required=True, help="source lines to encode")
    p.add_argument("--lines", type=cliargs.positive_int, default=2000, help="lines a round of encoding")
    p.add_argument("--seconds", type=cliargs.positive_float, default=0.5, help="how long each row's loop runs")
    p.add_argument("--block-ms", type=cliargs.positive_float, nargs="+", default=[2.4, 0.3],
                   help="the GPU's time a block (H200: 8 greedy steps at 64k tokens ~2.4, one step at batch 1 ~0.3)")
    p.add_argument("--intervals", type=cliargs.positive_float, nargs="+", default=[5.0, 1.0, 0.2],
                   help="switch intervals to try, in ms (Python's default is 5)")
    p.add_argument("--out", help="also write PREFIX.md and PREFIX.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    cliargs.refuse_missing(a.model, src=a.src)
    machine = one_line(describe())
    rows, reads = run(a), read_rows_ms()
    md = to_markdown(rows, machine) + (
        f"\nA batch's outputs ({reads['rows']:,} x {reads['T']}) read into lists: one `tolist` {reads['tolist_ms']} ms "
        f"(one C call, the GIL held), with the scan for </s> {reads['tolist_and_scan_ms']} ms; "
        f"`Later.until`, a row at a time, {reads['until_ms']} ms.\n")
    print(md, end="")
    if a.out:
        with open(a.out + ".md", "w", encoding="utf-8") as fh:
            fh.write(md)
        with open(a.out + ".json", "w", encoding="utf-8") as fh:
            json.dump({"machine": machine, "rows": rows, "read_outputs": reads}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
