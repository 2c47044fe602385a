"""python -m tools.bench_fused --model DIR [--src F --ref F] [--threads N] [--passes K] [--precision P] [--against A]

The fused kernels and the lexical shortlist against the plain decoder (fp32, or --precision), each
switch alone; or (`--against shipped`) each switch flipped alone (on, off; off, on) against the decoder as
shipped (its defaults, `auto` precision, one 1-thread worker per thread, the model's
shortlist): whether each default earns its place. All configurations of a group
are built first, then timed in turns, pass after pass, and the fastest pass counts, so
drifting load on a shared machine hits every configuration alike. Prints a markdown table
(docs/bench/fused-and-shortlist-*.md).
"""
from __future__ import annotations

import argparse
import os

import torch

from decoder import cliargs, ops
from decoder.machine import cpu_info
from decoder.optimisations import OPTIMISATIONS, group, kernels_off
from decoder.translator import Translator

from .baselines import alternating
from .bench import add_test_set_args, read_test_set, scores

PLAIN = kernels_off()  # every fused switch off, whatever the decoder's defaults: each row adds its own


def rows() -> tuple[dict, dict]:
    """(greedy rows, beam rows): name -> switches, generated from decoder/optimisations.py."""
    step, greedy = group("step"), group("greedy")
    all_step = {o.name: True for o in step}
    g = {"plain (best fp32 greedy)": {}}
    g.update({f"+ {o.label}": {**o.row, o.name: True} for o in step + greedy})
    g[f"+ all of {', '.join(o.name for o in step)}"] = all_step
    g.update({f"+ all of those + {o.label}": {**all_step, **o.row, o.name: True} for o in greedy})
    g.update({f"+ {o.label} (no fused kernels)": {o.name: True} for o in group("shortlist")})
    b, cur = {"beam 4 (plain)": dict(beam=4)}, dict(beam=4)
    for o in group("beam"):
        cur = {**cur, o.name: True}
        b[f"beam 4 + {o.label}"] = dict(cur)
    b.update({f"beam 4 + {o.label}": dict(beam=4, **{o.name: True}) for o in group("shortlist")})
    return g, b


def shipped_rows() -> tuple[dict, dict]:
    """(greedy rows, beam rows) against the shipped decoder: each CPU switch flipped alone (one
    that ships on, off; one that ships off, on): whether each default still earns its place.
    The batch-1, n-gram and CUDA switches apply to none of these rows."""
    flip = [o for o in OPTIMISATIONS if o.bench not in ("batch1", "ngram", "cuda")]

    def row(o):
        return ("+ " if not o.default else "- ") + o.name, {**(o.row if not o.default else {}), o.name: not o.default}
    g = {"shipped (greedy)": {}}
    g.update(row(o) for o in flip if o.bench != "beam")
    b = {"shipped (beam 4)": dict(beam=4)}
    b.update((f"beam 4 {k}", dict(beam=4, **kw)) for k, kw in map(row, flip))
    return g, b


def parse_args(argv=None) -> argparse.Namespace:
    p = cliargs.ArgumentParser(prog="python -m tools.bench_fused", description=__doc__.split("\n\n")[1],
                               formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    add_test_set_args(p)
    p.add_argument("--threads", type=cliargs.positive_int, default=2)
    p.add_argument("--precision", choices=("fp32", "int8", "bf16", "auto"), default=None,
                   help="of every row (default: fp32 against plain, auto against shipped)")
    p.add_argument("--against", choices=("plain", "shipped"), default="plain",
                   help="plain: each kernel against every fused switch off; shipped: each switch flipped alone "
                        "against the shipped decoder (workers and shortlist as shipped)")
    return p.parse_args(argv)


def build_group(model: str, configs: dict, base: dict, precision: str) -> dict:
    """name -> Translator of one group, its first row the group's baseline; a row whose plan runs
    the same as the first's (the switch does not apply: its needs, this CPU) is left out."""
    first_key, *others = configs
    trs = {first_key: Translator(model, precision=precision, **{**base, **configs[first_key]})}
    for k in others:
        tr = Translator(model, precision=trs[first_key].precision, **{**base, **configs[k]})
        if tr.plan.runs == trs[first_key].plan.runs:
            tr.close()
        else:
            trs[k] = tr
    return trs


def main(argv=None):
    a = parse_args(argv)
    shipped = a.against == "shipped"
    precision = a.precision or ("auto" if shipped else "fp32")
    src, ref = read_test_set(a)
    words = sum(len(s.split()) for s in src)
    shortlist = os.path.exists(os.path.join(a.model, "shortlist.safetensors"))
    # shipped: CPU-ALL as the container runs it, one 1-thread worker per thread
    base = dict(workers=a.threads if a.threads > 1 else 0, shortlist=shortlist) if shipped else PLAIN
    torch.set_num_threads(1 if shipped else a.threads)
    table = []
    for configs in (shipped_rows() if shipped else rows()):
        configs = {k: kw for k, kw in configs.items() if shortlist or not kw.get("shortlist")}
        trs = build_group(a.model, configs, base, precision)
        precision = next(iter(trs.values())).precision  # `auto` resolved once, not once per row
        timed = alternating([tr.translate for tr in trs.values()], src, a.passes)  # [(outputs, seconds)]
        first_out, first_s = timed[0]
        runs = next(iter(trs.values())).plan.runs
        table += [(k, words / s, first_s / s, scores(out, ref)[0], out == first_out,
                   " ".join(sorted(runs ^ tr.plan.runs)))
                  for (k, tr), (out, s) in zip(trs.items(), timed)]
        for tr in trs.values():
            tr.close()
    how = f"{a.threads} threads"
    if shipped:
        how = (f"{a.threads} 1-thread workers" if a.threads > 1 else "one thread") + \
            f", shortlist {'on' if shortlist else 'absent'}"
    m = cpu_info()
    print(f"Machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}; torch {torch.__version__}, "
          f"our kernels {ops.kernel_isa() if ops.available() else 'not loaded'}; {how}, {precision}. {len(src)} "
          f"lines ({words} words), fastest of {a.passes} interleaved passes.\n")
    first = "shipped" if shipped else "plain"
    print(f"| configuration | words/s | x {first} | BLEU | same output as {first} | switches that differ |\n"
          "|---|---:|---:|---:|---|---|")
    for k, w, x, b, same, differ in table:
        print(f"| {k} | {w:,.0f} | {x:.3f} | {b:.2f} | {'yes' if same else 'no'} | {differ} |")


if __name__ == "__main__":
    main()
