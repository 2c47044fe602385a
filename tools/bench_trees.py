"""python -m tools.bench_trees --before DIR --after DIR --model M --src F [--rounds N] [--isa avx2]

One decoder against another: the same model and input decoded by the checkouts `--before`
and `--after` (each its own process, on its own code), the trees alternating round by round,
in the three groups of `tools.bench` (throughput and beam 4 on 2 threads, batch 1 on one
thread, one sentence a call), at the same settings on both (int8; the model dir's shortlist
named, so a tree whose default differs runs the same thing). Prints each round, then per group
the best pass of each tree, their ratio, the ratio of the medians and whether the outputs are
identical. `--isa avx2` caps every engine to AVX2 (torch, oneDNN, fbgemm, our kernels).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

BATCH1_LINES = 150


def time_here(model: str, src: str, passes: int, lines: int) -> dict:
    """This tree's decoder (the one on sys.path) in the three groups: {group: {words_s, out}}.
    It runs on the measured tree's code, which may predate this file: it uses `Translator`
    alone, with the keywords every version of it took."""
    import torch
    from decoder import Translator
    text = [x.rstrip("\n") for x in open(src, encoding="utf-8")][:lines or None]
    shortlist = dict(shortlist=os.path.exists(os.path.join(model, "shortlist.safetensors")))

    def best(fn, words):
        times, out = [], None
        for _ in range(passes):
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
        return dict(words_s=words / min(times), out=out)
    res = {}
    torch.set_num_threads(2)
    for group, kw in (("throughput", {}), ("beam4", {"beam": 4})):
        tr = Translator(model, precision="int8", **kw, **shortlist)
        tr.translate(text[:50])  # warm-up
        res[group] = best(lambda: tr.translate(text), sum(len(x.split()) for x in text))
    tr = Translator(model, precision="int8", threads=1, **shortlist)
    one = text[:BATCH1_LINES]
    tr.translate(one[:5])
    res["batch1"] = best(lambda: [tr.translate([x])[0] for x in one], sum(len(x.split()) for x in one))
    return res


def run_tree(tree: str, a, env: dict) -> dict:
    """One tree's `time_here` in a process of its own: this file run by path, that tree's
    `decoder` first on the path (the tree need not have tools/bench_trees.py)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--time-here", os.path.abspath(a.model),
           os.path.abspath(a.src), str(a.passes), str(a.lines)]
    p = subprocess.run(cmd, cwd=tree, env={**env, "PYTHONPATH": tree}, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{tree}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def compare(a, log=print) -> dict:
    from tools.bench import CAPPED  # the ISA caps tools.bench puts on every engine
    env = {**os.environ, **CAPPED.get(a.isa, {})}
    trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    speeds: dict = {name: {} for name in trees}
    outs: dict = {}
    for r in range(a.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for name, tree in order:
            res = run_tree(tree, a, env)
            for group, v in res.items():
                speeds[name].setdefault(group, []).append(v["words_s"])
                outs[name, group] = v["out"]
            log(f"round {r} {name}: " + ", ".join(f"{g} {v['words_s']:,.0f}" for g, v in res.items()))
    return {g: dict(before=round(max(speeds["before"][g])), after=round(max(speeds["after"][g])),
                    ratio=round(max(speeds["after"][g]) / max(speeds["before"][g]), 3),
                    median_ratio=round(statistics.median(speeds["after"][g])
                                       / statistics.median(speeds["before"][g]), 3),
                    same_outputs=outs["before", g] == outs["after", g]) for g in speeds["after"]}


def parse_args(argv=None):
    from decoder import cliargs
    p = cliargs.ArgumentParser(prog="python -m tools.bench_trees", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="DIR", help="the checkout measured first (its decoder/)")
    p.add_argument("--after", metavar="DIR", help="the checkout measured against it")
    p.add_argument("--model", required=True, metavar="DIR", help="model dir both decode")
    p.add_argument("--src", required=True, metavar="FILE", help="source lines")
    p.add_argument("--rounds", type=cliargs.positive_int, default=3, help="rounds, each tree once a round (default 3)")
    p.add_argument("--passes", type=cliargs.positive_int, default=2, help="timed passes a group per round (default 2)")
    p.add_argument("--lines", type=cliargs.nonneg_int, default=0, help="the first N lines only (default 0: all)")
    p.add_argument("--isa", choices=("native", "avx2"), default="native", help="native, or every engine capped to AVX2")
    cliargs.add_version(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from decoder import machine
    a = parse_args(argv)
    for flag in ("before", "after"):
        if not os.path.isdir(os.path.join(getattr(a, flag) or "", "decoder")):
            print(f"error: --{flag} {getattr(a, flag)}: not a checkout of the kit (no decoder/)", file=sys.stderr)
            return 2
    print(machine.one_line(machine.describe()), flush=True)
    print(json.dumps({"isa": a.isa, "groups": compare(a, lambda m: print(m, flush=True))}, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--time-here"]:  # one tree's run (run_tree): model, src, passes, lines
        model, src, passes, lines = sys.argv[2:6]
        print(json.dumps(time_here(model, src, int(passes), int(lines))))
        sys.exit(0)
    from decoder import cliargs
    sys.exit(cliargs.run(main))
