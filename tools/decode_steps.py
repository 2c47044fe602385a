"""How many decode steps a greedy run takes, per batch against refilled rows (switch refill_rows);
with --beam, what a beam search's reorders move (switch kv_row_table) and its rows' steps (narrow_beam).

    python -m tools.decode_steps --model DIR --src FILE [--lines 10000] [--max-tokens 65536]
        [--max-sentences 8192] [--sync-every 8] [--chunk-lines 20000] [--beam 1] [--out PREFIX]

On a GPU each step costs a few dozen kernels' launches and latency, and at
thousands of rows their time grows with the rows too (on the H200 the decode
attention, most of a step's GPU time, took 0.46 ms a call at 4,096 rows and
0.91 at 8,192), so both the steps and the row-steps are what a throughput run
costs there. This counts them on any machine: the fixed-shape state the GPU's
graphs replay runs eagerly here (static shapes), at the GPU's batch settings by
default, once with a state per batch (`--no-refill-rows`), once with the
chunk's sentences streaming through one state (decoder/refill.py), once more
with the chunk's longest lines (by characters) first, the rest joining as
encoded (switch early_start; here the rest is encoded long before the first
block ends, so its steps are a lower bound of a GPU's), and once with the rows
refilled on the device each step (switch refill_on_device); the host's refill
runs once more with the state narrowed to its busy rows once no sentence waits
(switch narrow_tail; the rows of the states it ran are listed). For each:
steps, row-steps (rows x steps: what a compute-bound device pays), the states'
rows, and whether every output is the same. The wall time is this machine's,
not a GPU's.

With --beam K the same fixed-shape state runs the graphs' beam loop (at the
GPU's beam defaults: 65536 / K tokens, 8192 / K sentences), once moving its K/V
buffer at each step's reorder and once moving a row table (switch
kv_row_table), then once more with the unfinished sentences moved to a
narrower state whenever they hold at most half of its rows (switch
narrow_beam); the reorder traffic is what each step's reorder reads and writes
(an index_select and a copy back: the moved tensor twice each way), at the
GPU's fp16 for the K/V buffer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from decoder import Options, Translator, cliargs, static_steps
from decoder.machine import describe, one_line

from .bench import read


@contextlib.contextmanager
def counting(owner, name: str, record):
    """`record(obj)` of each call of the method owner.name meanwhile, in a list (the method still
    runs)."""
    seen: list = []
    run = getattr(owner, name)

    def counted(obj, *args, **kw):
        seen.append(record(obj))
        return run(obj, *args, **kw)
    setattr(owner, name, counted)
    try:
        yield seen
    finally:
        setattr(owner, name, run)


def counted_blocks():
    """The (rows, steps) of each block of greedy steps the fixed-shape loops run meanwhile
    (decoder/static_steps.py StaticGreedy, refilled or not), in a list."""
    return counting(static_steps.StaticGreedy, "run", lambda loop: (loop.cache.tokens.shape[0], loop.block))


def reorder_traffic(loop) -> tuple[int, int]:
    """(rows, bytes read and written by its reorder) of a whole beam step on the fixed-shape state:
    the moved tensor, the K/V buffer at the GPU's fp16 or the row table, read and written twice (an
    index_select and a copy back: decoder/cache.py StaticCache.reorder_all)."""
    c = loop.cache
    moved, size = (c.kv, 2) if c.table is None else (c.table, c.table.element_size())
    return c.kv.shape[2], 4 * moved.numel() * size


def counted_beam_steps():
    """`reorder_traffic` of each whole beam step the fixed-shape loop runs meanwhile
    (decoder/static_steps.py StaticBeam.run: one a step, replayed or eager), in a list."""
    return counting(static_steps.StaticBeam, "run", reorder_traffic)


def steps_of(blocks: list[tuple[int, int]]) -> dict:
    return {"steps": sum(s for _, s in blocks), "row_steps": sum(r * s for r, s in blocks),
            "rows": sorted({r for r, _ in blocks})}


def count(model: str, lines: list[str], switches: dict, **kw) -> tuple[dict, list[str]]:
    """One run's steps, row-steps and state widths (beam: and reorder traffic), and its outputs, at
    these loop `switches`."""
    tr = Translator(model, static_shapes=True, **switches, **kw)
    with counted_blocks() as blocks, counted_beam_steps() as beam_steps:
        start = time.perf_counter()
        out = tr.translate(lines)
        wall = time.perf_counter() - start
    if tr.plan.loop == "beam":
        counted = {**steps_of([(rows, 1) for rows, _ in beam_steps]),
                   "reorder_bytes": sum(b for _, b in beam_steps)}
    else:
        counted = steps_of(blocks)
    return {"loop": loop_of(tr.plan), **{k: k in tr.plan.runs for k in switches}, **counted,
            "wall_s": round(wall, 2)}, out


# the loops counted, the first the reference of "same outputs"
LOOPS = {"a state per batch": dict(refill_rows=False, early_start=False, refill_on_device=False, narrow_tail=False),
         "refilled rows": dict(refill_rows=True, early_start=False, refill_on_device=False, narrow_tail=False),
         "refilled rows, the tail narrowed (narrow_tail)":
             dict(refill_rows=True, early_start=False, refill_on_device=False, narrow_tail=True),
         "refilled rows, the chunk's longest lines first (early_start)":
             dict(refill_rows=True, early_start=True, refill_on_device=False, narrow_tail=False),
         "refilled rows on the device, each step (refill_on_device)":
             dict(refill_rows=True, early_start=False, refill_on_device=True, narrow_tail=False)}


# beam search's loops, the first the reference: its reorder moves the K/V buffer or a row table; its
# unfinished sentences stay in the batch's state or move to narrower ones
BEAM_LOOPS = {"beam, the K/V buffer moved at each reorder": dict(kv_row_table=False, narrow_beam=False),
              "beam, a row table moved at each reorder (kv_row_table)": dict(kv_row_table=True, narrow_beam=False),
              "beam, the row table, unfinished sentences moved to narrower states (narrow_beam)":
                  dict(kv_row_table=True, narrow_beam=True)}


def loop_of(plan) -> str:
    """The LOOPS (BEAM_LOOPS) label of what `plan` runs."""
    loops = BEAM_LOOPS if plan.loop == "beam" else LOOPS
    on = {k for k in next(iter(loops.values())) if k in plan.runs}
    return next(label for label, sw in loops.items() if on == {k for k, v in sw.items() if v})


def to_markdown(rows: list[dict], machine: str, settings: dict) -> str:
    beam = "reorder_bytes" in rows[0]
    out = [f"Machine: {machine}", "", "Settings: " + ", ".join(f"{k} {v}" for k, v in settings.items()), "",
           "| loop | steps | row-steps | states' rows |" + (" reorder traffic (GB) |" if beam else "")
           + " same outputs | wall here (s) |", "|---|---:|---:|---|" + ("---:|" if beam else "") + "---|---:|"]
    out += [f"| {r['loop']} | {r['steps']:,} | {r['row_steps']:,} | {', '.join(map(str, r['rows']))} |"
            + (f" {r['reorder_bytes'] / 1e9:,.3f} |" if beam else "") + f" {r['same_outputs']} | {r['wall_s']} |" for r in rows]
    return "\n".join(out) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = cliargs.ArgumentParser(prog="python -m tools.decode_steps", description=__doc__.split("\n\n")[0])
    cliargs.add_version(p)
    p.add_argument("--model", required=True, help="model dir")
    p.add_argument("--src", required=True, help="source lines")
    p.add_argument("--lines", type=cliargs.positive_int, default=10000, help="first N lines")
    p.add_argument("--max-tokens", type=cliargs.positive_int, default=None,
                   help=f"padded source tokens a batch (default: the GPU's, {cliargs.GPU_MAX_TOKENS} / beam size)")
    p.add_argument("--max-sentences", type=cliargs.positive_int, default=None,
                   help=f"sentences a batch (default: the GPU's, {cliargs.GPU_MAX_SENTENCES} / beam size)")
    p.add_argument("--sync-every", type=cliargs.positive_int, default=8, help="steps a block (the GPU's)")
    p.add_argument("--chunk-lines", type=cliargs.positive_int, default=Options.chunk_lines,
                   help="lines a chunk (the decoder's default): each chunk's state ends with its longest output")
    p.add_argument("--beam", type=cliargs.int_range(1, cliargs.MAX_BEAM), default=1,
                   help="beam size; above 1 the beam loop's reorders are counted (kv_row_table off and on, "
                        "then narrow_beam on)")
    p.add_argument("--threads", type=cliargs.positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", help="also write PREFIX.md and PREFIX.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    cliargs.refuse_missing(a.model, src=a.src)
    lines = read(a.src)[:a.lines]
    max_tokens = a.max_tokens or cliargs.max_tokens_for(a.beam, "cuda")
    max_sentences = a.max_sentences or cliargs.max_sentences_for(a.beam, "cuda")
    settings = {"lines": len(lines), "max_tokens": max_tokens, "max_sentences": max_sentences,
                "sync_every": a.sync_every, "chunk_lines": a.chunk_lines, **({"beam": a.beam} if a.beam > 1 else {})}
    kw = dict(max_tokens=max_tokens, max_sentences=max_sentences, sync_every=a.sync_every,
              chunk_lines=a.chunk_lines, threads=a.threads)
    if a.beam > 1:  # the fixed-address beam step takes its top-k from the logits (graph_steps)
        kw.update(beam=a.beam, fused_project_topk=False)
    loops = BEAM_LOOPS if a.beam > 1 else LOOPS
    (per_batch, want), *others = (count(a.model, lines, sw, **kw) for sw in loops.values())
    per_batch["same_outputs"] = "-"
    for row, got in others:
        row["same_outputs"] = f"{sum(x == y for x, y in zip(want, got)):,} of {len(lines):,}"
    rows = [per_batch] + [row for row, _ in others]
    machine = one_line(describe())
    md = to_markdown(rows, machine, settings)
    print(md, end="")
    if a.out:
        with open(a.out + ".md", "w", encoding="utf-8") as fh:
            fh.write(md)
        with open(a.out + ".json", "w", encoding="utf-8") as fh:
            json.dump({"machine": machine, "settings": settings, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
