"""python -m tools.bench_gpu --model DIR --src F --ref F [--lines N] [--time-limit S] [--out PREFIX] [--summary FILE]

Our decoder on a CUDA GPU beside CTranslate2 (float16 and int8_float16) and
transformers fp16 `generate`, on the same weights (tools/convert), in the CPU
bench's three groups: throughput (greedy, every line), beam 4 (the first
--beam-lines) and batch 1 (the first --batch1-lines, one sentence a call).
Every engine runs a sweep of batch sizes per group (SWEEPS, each size a row of
the table), and its fastest row is its best; a group's ratio is our best over
CTranslate2's best (either compute type). Ours is fp16 with the decoder's
defaults: one row at its own batch default, one per swept size. Our best
throughput row then runs once more under torch.profiler: the time the GPU ran
our CUDA kernels (the union of their intervals) over that row's wall is
`gpu_busy`; our best beam-4 row too (the profile's "beam4"). CTranslate2 and transformers are not profiled: CTranslate2's
kernels are not visible to torch.profiler at all. The lines are one chunk of
the text pipeline; --chunked adds ours in chunks of that many lines, as a run
of more than `chunk_lines` lines reads them (the next chunk encoded beside the
decoding), --ablate ours with single switches flipped or settings changed, and
--processes ours in several processes on the one GPU.

CTranslate2 runs as it is plainly used on a GPU: the whole input in one
`translate_batch` call with one length cap (the longest sentence's), which it
sorts and cuts into batches of the swept size. At its best size it also runs
with the caps of our decoder (one call per cap, as tools.bench does on a CPU:
the same outputs as ours, but 93 calls of about 80 sentences for the 10,000
lines, whatever the size), those calls with `inter_threads` 4, and one cap
with `inter_threads` 2 and 4 (batches on several CUDA streams, which its
parallelism guide offers for a GPU); its best row of all is the denominator.

Writes PREFIX.md and PREFIX.json (every row of every sweep) after every row,
marked partial until the run ends, then the summary (one object in a list, as
tools.bench's summary.json: the same ratio keys plus device, gpu,
src_words_per_s, gpu_busy and the versions). --time-limit leaves out, and
records, the rows that would end past it: a lent GPU's call has a hard limit.
Needs CUDA: without it, one error line and exit 2 (the CPU benchmark is
tools.bench).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

import torch

from decoder import cliargs, machine, modeldir, search
from decoder.__main__ import knob_type
from decoder.optimisations import BY_NAME
from decoder.pipeline import normalise_processes, shares

from .baselines import CT2Run, ct2_translator, fastest, hf_translator
from .bench import GROUPS, SUMMARY_RATIOS, Timeline, add_test_set_args, ours_go, read_test_set, scores

BEAM = {"throughput": 1, "beam4": 4, "batch1": 1}
CT2_TYPES = ("float16", "int8_float16")
ENGINES = ("ours", "ct2", "hf")
# group -> engine -> batch sizes, in order. ours and CTranslate2: padded source tokens a batch (ours'
# None: the decoder's own default for the device); transformers: sentences a batch. The ranges bracket
# what the GPU runs found best (H200: ours 64k greedy and 32k beam 4, the top of its beam sweep then,
# CTranslate2 8k-16k; H100: transformers 256 greedy), ours one size past its best; ours and CTranslate2,
# one pass a row and the --ablate rows, took 4 minutes on the H200.
SWEEPS = {
    "throughput": {"ours": (None, 8192, 16384, 32768, 65536, 131072), "ct2": (8192, 16384, 32768, 65536),
                   "hf": (128, 256, 512)},
    "beam4": {"ours": (None, 4096, 8192, 16384, 32768, 65536), "ct2": (2048, 4096, 8192, 16384), "hf": (32, 64, 128)},
    "batch1": {"ours": (1,), "ct2": (1,), "hf": (1,)},
}
# CTranslate2's ways, each a row at its sweep's best size (throughput and beam 4): (label, CT2Run fields).
# Its sweep rows are ONE_CAP. Until 2026-11-27 every GPU row ran in our caps' calls: at 10,000 lines
# 93 calls of at most 11k tokens (beam 4: 72 calls, 14 sentences at the median), so its swept
# sizes hardly changed its batches.
ONE_CAP = "one cap"
CT2_WAYS = (("caps as ours", {"one_cap": False}),
            ("caps as ours, inter_threads 4", {"one_cap": False, "inter_threads": 4}),
            ("one cap, inter_threads 2", {"inter_threads": 2}), ("one cap, inter_threads 4", {"inter_threads": 4}))
PARTIAL = "(Partial: written after each row; the run has not ended.)"
NOT_PROFILED = ("CTranslate2 runs its own CUDA kernels, which torch.profiler does not see: it has no GPU-busy "
                "figure; transformers is not profiled")


def is_oom(e: BaseException) -> bool:
    """Out of GPU memory, as torch and CTranslate2 say it."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def out_of_memory(e: Exception) -> dict:
    """A row's result where running out of GPU memory is one (the cache emptied for the next row);
    any other error re-raised."""
    if not is_oom(e):
        raise e
    torch.cuda.empty_cache()
    return {"error": "out of memory"}


def ct2_one_cap(group: str) -> bool:
    """CTranslate2 in one call with one cap, its plain use, except at batch 1 (a sentence a call)."""
    return group != "batch1"


class TimeUp(Exception):
    """A row that the time limit leaves out (--time-limit)."""


NOT_RUN = "not run: time limit"


class Deadline:
    """--time-limit: a row starts only where the slowest row so far of its group and engine (`slot`:
    its loading, warm-up and passes) would still end in time, so a lent GPU's call ends with its
    files written rather than cut mid-row. No limit: every row runs."""

    def __init__(self, seconds: float | None, clock=time.monotonic):
        self.clock = clock
        self.end = clock() + seconds if seconds else None
        self.took: dict[tuple, float] = {}  # slot -> its slowest row's seconds

    def allows(self, slot: tuple, factor: float = 1.0) -> bool:
        return self.end is None or self.clock() + factor * self.took.get(slot, 0.0) < self.end

    def check(self, slot: tuple, factor: float = 1.0) -> None:
        if not self.allows(slot, factor):
            raise TimeUp

    @contextlib.contextmanager
    def timing(self, slot: tuple):
        t = self.clock()
        yield
        self.took[slot] = max(self.took.get(slot, 0.0), self.clock() - t)


def slot(group: str, engine: str) -> tuple[str, str]:
    """The rows a row's time is estimated from: its group's rows of the same engine, ours' --ablate
    and --chunked rows with ours' (H200, 2026-11-27: CTranslate2's first throughput row took 27 s with
    its conversion, ours 7 s, and the 27 s left out every ablation row of ours)."""
    return group, "ours" if engine.startswith(("ours", ABLATION)) else engine


def sweep(run, sizes, each=None) -> list[dict]:
    """[{"batch": size, **run(size)}] in order, each also given to `each` as it is made. A size that
    runs out of GPU memory is recorded as such and ends the sweep (the larger ones only need more);
    one that run leaves out for the time limit (TimeUp) is recorded, as are the sizes after it; any
    other error is raised."""
    rows = []
    for i, s in enumerate(sizes):
        try:
            made = [{"batch": s, **run(s)}]
        except TimeUp:
            made = [{"batch": x, "error": NOT_RUN} for x in sizes[i:]]
        except Exception as e:  # noqa: BLE001 - only out-of-memory is a result; the rest re-raised
            made = [{"batch": s, **out_of_memory(e)}]
        for r in made:
            rows.append(r)
            if each is not None:
                each(r)
        if "error" in made[0]:
            break
    return rows


def best(rows: list[dict], group: str, engine: str) -> dict | None:
    """The fastest row of an engine ("ours", "ct2", "hf" or one compute type "ct2 float16") in a group."""
    ok = [r for r in rows if r["group"] == group and "error" not in r
          and (r["engine"] == engine or r["engine"].split()[0] == engine)]
    return max(ok, key=lambda r: r["src_words_per_s"], default=None)


def ratio(a: dict | None, b: dict | None) -> float | None:
    return round(a["src_words_per_s"] / b["src_words_per_s"], 3) if a and b else None


def summary(rows: list[dict], gpu_busy: float | None, about: dict) -> dict:
    """The summary object: the CPU bench's ratio keys (our best over CTranslate2's best per group),
    each group's ratio against float16 alone, our best throughput and the GPU-busy figure."""
    ours = best(rows, "throughput", "ours")
    return {"device": "cuda", **about, "src_words_per_s": ours and ours["src_words_per_s"], "gpu_busy": gpu_busy,
            **{SUMMARY_RATIOS[g]: ratio(best(rows, g, "ours"), best(rows, g, "ct2")) for g in GROUPS},
            "vs_ct2_float16": {g: ratio(best(rows, g, "ours"), best(rows, g, "ct2 float16")) for g in GROUPS}}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: kernels on several streams at once count once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def busy_fraction(intervals: list[tuple[float, float]], wall: float) -> float:
    """union_length(intervals) over `wall` (same unit), at most 1."""
    return round(min(union_length(intervals) / wall, 1.0), 4) if wall > 0 else 0.0


def idle_parts(intervals: list[tuple[float, float]], start: float, end: float) -> dict:
    """Where the GPU waited in the pass [start, end) (same unit as the intervals, microseconds):
    before its first kernel (the first chunk's encoding on the host), between kernels (the host
    feeding it too slowly) and after its last (the last outputs read, detokenised, written); seconds."""
    iv = [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]
    if not iv:
        return {"idle_before_s": round((end - start) / 1e6, 4), "idle_between_s": 0.0, "idle_after_s": 0.0}
    first, last = min(a for a, _ in iv), max(b for _, b in iv)
    return {"idle_before_s": round((first - start) / 1e6, 4),
            "idle_between_s": round((last - first - union_length(iv)) / 1e6, 4),
            "idle_after_s": round((end - last) / 1e6, 4)}


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start, end), in microseconds, of every CUDA kernel a torch.profiler run saw (copies and
    memsets out)."""
    from torch.autograd import DeviceType
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset", "[memory]"))]


def kernel_shares(events: list[tuple[str, float, float]], n: int = 8) -> list[dict]:
    """The n kernels with the most GPU time, each with its calls and share of all kernels' time:
    where the GPU's time goes (on the H100, cuDNN's flash attention was a third of it)."""
    us, calls = Counter(), Counter()
    for name, a, b in events:
        us[name] += b - a
        calls[name] += 1
    total = sum(us.values()) or 1.0
    return [{"kernel": k, "calls": calls[k], "us": round(t, 1), "share": round(t / total, 4)}
            for k, t in us.most_common(n)]


def profile_busy(go, lines: list[str], wall_s: float) -> dict:
    """One of our best rows once under torch.profiler. gpu_busy: kernel time over that row's
    unprofiled wall (`wall_s`); busy_under_profiler: over the profiled wall, lower, as the profiler
    slows the host that feeds the GPU; the fixed-shape loops' steps, greedy blocks or beam steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, \
            counted(search.Greedy, lambda g: (g.tokens.shape[0], g.s.every)) as blocks, \
            counted(search.Beam, lambda b: (b.tokens.shape[0], 1)) as beam_steps:
        t = time.perf_counter()
        with torch.profiler.record_function(PASS):
            go(lines)
            torch.cuda.synchronize()
        profiled = time.perf_counter() - t
    events = kernel_events(prof)
    iv = [(a, b) for _, a, b in events]
    kernel_s = union_length(iv) / 1e6
    marks = [e.time_range for e in prof.events() if e.name == PASS]
    idle = idle_parts(iv, marks[0].start, marks[0].end) if marks else {}
    loop, steps = (("beam", steps_of([(rows, 1) for rows, _ in beam_steps])) if beam_steps
                   else ("greedy", steps_of(blocks)))
    return {"gpu_busy": busy_fraction(iv, wall_s * 1e6), "kernel_s": round(kernel_s, 4), "wall_s": round(wall_s, 4),
            "profiled_wall_s": round(profiled, 4), "busy_under_profiler": busy_fraction(iv, profiled * 1e6),
            "kernels": len(iv), "top_kernels": kernel_shares(events), **idle, "loop": loop, **steps}


PASS = "kit.bench_pass"  # the profiled pass's own range, in the kernels' clock


@contextlib.contextmanager
def counted(cls, what):
    """`what(search)` of each block of steps a fixed-shape search (decoder/search.py Greedy, Beam)
    runs meanwhile, eager or replayed, in a list: (rows, steps)."""
    seen, run = [], cls.run_block
    cls.run_block = lambda self, *a: (seen.append(what(self)), run(self, *a))[1]
    try:
        yield seen
    finally:
        cls.run_block = run


def steps_of(blocks: list[tuple[int, int]]) -> dict:
    return {"steps": sum(s for _, s in blocks), "row_steps": sum(r * s for r, s in blocks),
            "rows": sorted({r for r, _ in blocks})}


def host_timeline(go, lines: list[str], clock=time.perf_counter) -> dict:
    """The pass once more, unprofiled, with the host's clock on the translator's phases: when the
    host first encoded a batch and first issued a decode step (before that the GPU waits for the
    text pipeline: normalisation, SentencePiece, sorting), and when it last did (after that, the
    last reads and the detokenising). The profiler's idle split slows the host it measures."""
    tr, timeline = go.translator, Timeline(clock)
    tr.phase = timeline.phase
    try:
        go(lines)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = clock() - timeline.start
    finally:
        del tr.phase  # the class's hook again
    return {"host_wall_s": round(wall, 4), "host_phases": timeline.summary()}


# -- the engines: each a context giving go(lines) -> hypotheses for one (group, batch size) ------------

class Engines:
    """The model dir, its CTranslate2 conversion (made once) and how each engine is loaded. `device`
    "cpu" (fp32, no half weights) is for the tests: the same code path, minus CUDA."""

    def __init__(self, model_dir: str, work: str, device: str = "cuda"):
        self.model_dir, self.work, self._ct2, self.device = model_dir, work, None, device
        self.precision = "fp16" if device == "cuda" else "fp32"

    def ct2_dir(self) -> str:
        if self._ct2 is None:
            from .convert import to_ctranslate2
            self._ct2 = to_ctranslate2(self.model_dir, os.path.join(self.work, "ct2"))
        return self._ct2

    def ours(self, group: str, size: int | None, **switches):
        on = dict(device=self.device, precision=self.precision, **switches)
        if group == "batch1":
            return ours_go(self.model_dir, os.cpu_count() or 1, True, **on)
        kw = {} if size is None else {"max_tokens": size, "max_sentences": max(size // 8, 1)}
        return ours_go(self.model_dir, os.cpu_count() or 1, False, beam=BEAM[group], **on, **kw)

    def ct2(self, compute_type: str, group: str, size: int, **how):
        """CTranslate2 loaded for a row: one cap (its plain use) unless `how` (CT2Run fields) says otherwise."""
        run = CT2Run(**{"compute_type": compute_type, "beam": BEAM[group], "max_batch_size": size,
                        "batch1": group == "batch1", "one_cap": ct2_one_cap(group), **how})
        if self.device != "cuda":  # CTranslate2's CPU kernels have no float16
            run = CT2Run(**{**run.__dict__, "compute_type": "float32" if compute_type == "float16" else "int8"})
        return _plain(ct2_translator(self.ct2_dir(), self.model_dir, run, device=self.device,
                                     text_processes=self.text_processes()))

    def hf(self, group: str, size: int):
        return _plain(hf_translator(self.model_dir, os.cpu_count() or 1, batch=size, beam=BEAM[group],
                                    device=self.device, half=self.device == "cuda",
                                    text_processes=self.text_processes()))

    def text_processes(self) -> int:
        """The normaliser's processes ours runs here (switch normalise_processes, on with CUDA), which
        the other engines' text pipeline gets too: the engines differ, their text costs do not."""
        return normalise_processes() if self.device == "cuda" else 0

    def ours_processes(self, group: str, size: int | None, n: int):
        """Ours in `n` processes on the one GPU, each a share of every pass's lines (--processes)."""
        kw = dict(device=self.device, precision=self.precision, beam=BEAM[group],
                  threads=max(1, (os.cpu_count() or 1) // n))
        if size is not None:
            kw.update(max_tokens=size, max_sentences=max(size // 8, 1))
        return _Processes(self.model_dir, kw, n)


_translator = None  # a --processes child's own Translator


def _child_load(model_dir: str, kw: dict) -> None:
    global _translator
    from decoder import Translator
    _translator = Translator(model_dir, **kw)


def _child_translate(lines: list[str]) -> list[str]:
    return _translator.translate(lines)


class _Processes:
    """`n` processes of ours on one GPU as a context giving go(lines): the lines in n contiguous
    shares of about equal characters, one a process, translated at once and joined in order. The
    decode loop is bound by the host that feeds the GPU (38% busy at our best H200 row): whether
    another process's host fills the gaps, where one process's threads share one GIL, is what the
    row measures. The shares' hand-over (pickled lines and outputs) is in the timed pass."""

    def __init__(self, model_dir: str, kw: dict, n: int):
        self.model_dir, self.kw, self.n, self.pools = model_dir, kw, n, []

    def __enter__(self):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        ctx = mp.get_context("spawn")  # CUDA in a forked child fails
        self.pools = [ProcessPoolExecutor(1, mp_context=ctx, initializer=_child_load,
                                          initargs=(self.model_dir, self.kw)) for _ in range(self.n)]
        for job in [p.submit(len, []) for p in self.pools]:
            job.result()  # every model loaded before the first pass; a child that cannot load raises here

        def go(lines: list[str]) -> list[str]:
            jobs = [(self.pools[i], lines[lo:hi]) for i, (lo, hi) in enumerate(shares(lines, self.n))]
            return [x for job in [pool.submit(_child_translate, part) for pool, part in jobs] for x in job.result()]
        return go

    def __exit__(self, *exc):
        for p in self.pools:
            p.shutdown(cancel_futures=True)
        self.pools = []


class _plain:
    """A loaded go() as a context, freeing the GPU memory it held on exit."""

    def __init__(self, go):
        self.go = go

    def __enter__(self):
        return self.go

    def __exit__(self, *exc):
        self.go = None
        torch.cuda.empty_cache()


def engine_list(engines: list[str], ct2_types=None) -> list[tuple[str, object]]:
    """[(row engine name, loader(engines, group, size))] of the engines asked for, CTranslate2 in
    each of `ct2_types` (default: CT2_TYPES)."""
    out = []
    if "ours" in engines:
        out.append(("ours fp16", lambda e, g, s: e.ours(g, s)))
    if "ct2" in engines:
        out += [(f"ct2 {t}", lambda e, g, s, t=t, **how: e.ct2(t, g, s, **how)) for t in ct2_types or CT2_TYPES]
    if "hf" in engines:
        out.append(("hf fp16", lambda e, g, s: e.hf(g, s)))
    return out


def timed(go, s: list[str], r: list[str], passes: int) -> dict:
    """One row: the fastest of `passes` passes of go over s, after a warm-up pass over every line
    (the first pass at a batch size pays for the GPU memory the allocator then keeps and for each
    shape's kernel plans and graphs; H200, 2026-11-26: warmed on 8 lines, the default row, 32k
    tokens, timed 52k words/s, the same size 179k three rows later), with BLEU and chrF."""
    tr = getattr(go, "translator", None)
    passes_seen = []  # (seconds, captures, their host seconds) of each pass, the warm-up's first

    def counted(lines):
        n, cs, t = tr.model.captures.count, tr.model.captures.seconds, time.perf_counter()
        out = go(lines)
        passes_seen.append((time.perf_counter() - t, tr.model.captures.count - n, tr.model.captures.seconds - cs))
        return out
    out, sec = fastest(go if tr is None else counted, s, passes, warm=None)
    bleu, chrf = scores(out, r)
    words = sum(len(x.split()) for x in s)
    row = {"src_words_per_s": round(words / sec, 1), "seconds": round(sec, 4), "bleu": bleu, "chrf": chrf}
    if tr is not None:
        if tr.model.graphs_failed:  # a capture failed: the row ran eagerly (H200, 2026-11-26)
            row["graphs_failed"] = True
        _, n, cs = min(passes_seen[1:])  # the fastest timed pass's: each pass captures its states anew
        row |= {"captures": n, "capture_s": round(cs, 4)}
    return row


ABLATION = "ablation: ours fp16"  # its rows' engine names: never any engine's best


def measured(deadline: Deadline, where: tuple, loaded, s: list[str], r: list[str], passes: int) -> dict:
    """timed() of the engine `loaded` (a context giving go) plus `row_s`, the row's seconds with its
    loading and warm-up: what the next session's plan needs, and its slot's estimate for --time-limit."""
    t = time.perf_counter()
    with deadline.timing(where), loaded as go:
        row = timed(go, s, r, passes)
    return {**row, "row_s": round(time.perf_counter() - t, 4)}


class Record:
    """The rows and the profile so far, handed to `write(rows, profile)` after each: a run cut short
    (a lent GPU's call has a hard limit) keeps what it measured."""

    def __init__(self, write=None):
        self.rows, self.prof, self.write = [], None, write

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.save()

    def save(self) -> None:
        if self.write is not None:
            self.write(self.rows, self.prof)


def extra_row(rec: Record, deadline: Deadline, group: str, engine: str, batch, lines: tuple, passes: int,
              loaded, how: str | None = None) -> dict | None:
    """One row beside the sweeps (ours' --ablate and --chunked, CTranslate2's other ways), `loaded`
    (a context, entered only if the row runs) on `lines` (src, ref): measured and recorded, or
    recorded as not run where the time limit leaves it out (None), or as out of GPU memory (None: a
    way that needs more than the sweep's row, as inter_threads 4, ends no run). `how`: the engine's
    settings."""
    s, r = lines
    base = {"group": group, "engine": engine, **({"how": how} if how else {}), "lines": len(s),
            "words": sum(len(x.split()) for x in s), "batch": batch}
    if not deadline.allows(slot(group, engine)):
        rec.add({**base, "error": NOT_RUN})
        return None
    try:
        row = measured(deadline, slot(group, engine), loaded, s, r, passes)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is a result; the rest re-raised
        rec.add({**base, **out_of_memory(e)})
        return None
    rec.add({**base, **row})
    return row


# Decoder settings an --ablate entry may set as NAME=VALUE, beside the switches it flips. sync_every:
# the steps between the host's reads of the finished rows (a greedy graph's block of steps).
SETTINGS = ("sync_every",)


def ablation(entry: str) -> tuple[str, dict]:
    """An --ablate entry as (its rows' label, ours' keyword arguments): a switch flipped from its
    default (on switches off, off ones on), or NAME=VALUE of SETTINGS, or several of those joined
    by '+', changed together. ValueError for anything else."""
    parts = [_one_change(x) for x in entry.split("+")]
    kw = {k: v for _, change in parts for k, v in change.items()}
    if len(kw) < len(parts):
        raise ValueError(f"{entry!r} changes one thing twice")
    return " + ".join(label for label, _ in parts), kw


def _one_change(entry: str) -> tuple[str, dict]:
    name, eq, value = (x.strip() for x in entry.partition("="))
    if eq:
        if name not in SETTINGS:
            raise ValueError(f"unknown setting {name!r}; the settings are {', '.join(SETTINGS)}")
        try:
            return f"{name}={value}", {name: knob_type(name)(value)}  # as `python -m decoder --set` takes it
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{name}={value}: {e}") from None
    if name not in BY_NAME:
        raise ValueError(f"unknown switch {name!r}; python -m decoder --list-switches lists them")
    flip = not BY_NAME[name].default
    return f"{'with' if flip else 'without'} {name}", {name: flip}


def ablation_groups(kw: dict) -> tuple:
    """The groups an --ablate change (`ablation`'s keywords) is measured in: a beam search switch's
    (its entry's bench "beam") in beam 4's, the rest at our best throughput and batch-1 sizes."""
    beam = any(name in BY_NAME and BY_NAME[name].bench == "beam" for name in kw)
    return ("beam4",) if beam else ("throughput", "batch1")


def ablation_rows(a, eng: "Engines", lines: dict, rec: Record, deadline: Deadline, log) -> None:
    """For each entry of --ablate (`ablation`), ours changed so at our best size of each of its
    groups (`ablation_groups`): what each optimisation or setting is worth on this GPU, beside the
    rows it is measured against."""
    for entry in a.ablate:
        label, kw = ablation(entry)
        for group in ablation_groups(kw):
            top = best(rec.rows, group, "ours")
            if top is None:
                continue
            row = extra_row(rec, deadline, group, f"{ABLATION} {label}", top["batch"], lines[group], a.passes,
                            eng.ours(group, top["batch"], **kw))
            if row is not None:
                log(f"{group:10} {label:26} batch {_label(top['batch']):>8}: {row['src_words_per_s']:12,.0f} "
                    f"words/s ({row['src_words_per_s'] / top['src_words_per_s']:.2f}x ours by default)")


def ct2_way_rows(name: str, load, eng: "Engines", group: str, lines: tuple, a, rec: Record, deadline: Deadline,
                 log) -> None:
    """CTranslate2 (`name`, its loader) at its best size of `group` in each of CT2_WAYS: rows of that
    engine, so its best row may be one of them."""
    top = best(rec.rows, group, name)
    if top is None or group == "batch1":
        return
    for how, kw in CT2_WAYS:
        row = extra_row(rec, deadline, group, name, top["batch"], lines, a.passes, load(eng, group, top["batch"], **kw),
                        how=how)
        if row is not None:
            log(f"{group:10} {name} ({how}) batch {_label(top['batch'])}: {row['src_words_per_s']:,.0f} words/s "
                f"({row['src_words_per_s'] / top['src_words_per_s']:.2f}x its one-cap row)  BLEU {row['bleu']}")


def process_rows(a, eng: "Engines", lines: dict, rec: Record, deadline: Deadline, log) -> None:
    """Ours in --processes processes at its best throughput size: an ablation-style row (never ours'
    best: the decoder runs one process on a GPU)."""
    top = best(rec.rows, "throughput", "ours")
    if getattr(a, "processes", 0) < 2 or top is None:
        return
    name = f"{ABLATION} in {a.processes} processes"
    try:
        row = extra_row(rec, deadline, "throughput", name, top["batch"], lines["throughput"], a.passes,
                        eng.ours_processes("throughput", top["batch"], a.processes))
    except RuntimeError as e:  # a child that could not load or died (BrokenProcessPool is one): the row's result
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        rec.add({"group": "throughput", "engine": name, "batch": top["batch"], "error": f"failed: {why}"})
        log(f"throughput {name[len(ABLATION) + 1:]}: failed: {why}")
        return
    if row is not None:
        log(f"throughput {name[len(ABLATION) + 1:]:44} batch {_label(top['batch']):>8}: "
            f"{row['src_words_per_s']:12,.0f} words/s ({row['src_words_per_s'] / top['src_words_per_s']:.2f}x "
            f"ours in one process)")


def chunked_rows(a, eng: "Engines", lines: dict, rec: Record, deadline: Deadline, log) -> None:
    """Ours at its best throughput size with the text read in chunks of --chunked lines, as every
    run of more than `chunk_lines` (20,000) lines is: the next chunk's encoding runs beside the
    decoding (the bench's lines are otherwise one chunk, encoded before any decoding). Then the
    same without short_gil_interval and without decode_ahead: what those switches are worth where
    the encoding thread is busy and chunks end."""
    top = best(rec.rows, "throughput", "ours")
    if not a.chunked or top is None:
        return
    for label, kw in (("", {}), (", without short_gil_interval", {"short_gil_interval": False}),
                      (", without decode_ahead", {"decode_ahead": False})):
        name = f"{ABLATION} chunks of {a.chunked} lines{label}"
        row = extra_row(rec, deadline, "throughput", name, top["batch"], lines["throughput"], a.passes,
                        eng.ours("throughput", top["batch"], chunk_lines=a.chunked, **kw))
        if row is not None:
            log(f"throughput {name[len(ABLATION) + 1:]:44} batch {_label(top['batch']):>8}: "
                f"{row['src_words_per_s']:12,.0f} words/s ({row['src_words_per_s'] / top['src_words_per_s']:.2f}x "
                f"ours in one chunk)")


# The profiled pass and its loading, against ours' slowest throughput row so far: the profiler slows the
# host. Its own time is kept apart (the "profile" slot), so it does not hold back the rows after it.
PROFILE_COST = 2.0


def profiled(eng: "Engines", src: list[str], rows: list[dict], deadline: Deadline, log,
             group: str = "throughput") -> dict | None:
    """Our best row of `group` (on its lines `src`) once more, under torch.profiler (None where the
    time limit leaves it out)."""
    top = best(rows, group, "ours")
    if top is None:
        return None
    if not deadline.allows(slot(group, "ours"), PROFILE_COST):
        log(f"profile    ours fp16 {group}: {NOT_RUN}")
        return None
    with deadline.timing((group, "profile")), eng.ours(group, top["batch"]) as go:
        go(src[:64])
        prof = {"batch": top["batch"], **profile_busy(go, src, top["seconds"]), **host_timeline(go, src)}
    log(profile_line(prof, group))
    return prof


def run_all(a, src: list[str], ref: list[str], log, device: str = "cuda", write=None,
            clock=time.monotonic) -> tuple[list[dict], dict | None]:
    """Every engine's sweep in every group, our best throughput row profiled as soon as ours' sweep
    of that group ends (the busy figure matters most), and our best beam-4 row (the profile's
    "beam4"), then the --ablate and --chunked rows; rows the time limit (a.time_limit seconds, if
    any) leaves out are recorded as such. `write(rows, profile)` after each row. (rows, the
    profile; None off CUDA or where left out)."""
    lines = {"throughput": (src, ref), "beam4": (src[:a.beam_lines], ref[:a.beam_lines]),
             "batch1": (src[:a.batch1_lines], ref[:a.batch1_lines])}
    rec, deadline = Record(write), Deadline(getattr(a, "time_limit", None), clock)
    with tempfile.TemporaryDirectory() as work:
        eng = Engines(a.model, work, device)
        for group in GROUPS:
            s, r = lines[group]
            words = sum(len(x.split()) for x in s)
            for name, load in engine_list(a.engines, getattr(a, "ct2_types", None)):
                def run(size, name=name, load=load):
                    deadline.check(slot(group, name))
                    row = measured(deadline, slot(group, name), load(eng, group, size), s, r, a.passes)
                    log(f"{group:10} {name:18} batch {_label(size):>8}: {row['src_words_per_s']:12,.0f} words/s  "
                        f"BLEU {row['bleu']}")
                    return row
                how = {"how": ONE_CAP} if name.startswith("ct2") and ct2_one_cap(group) else {}
                sweep(run, SWEEPS[group][name.split()[0]],
                      each=lambda row, name=name, how=how: rec.add({"group": group, "engine": name, **how,
                                                                    "lines": len(s), "words": words, **row}))
                if name.startswith("ct2"):
                    ct2_way_rows(name, load, eng, group, (s, r), a, rec, deadline, log)
                if group == "throughput" and name == "ours fp16" and device == "cuda":
                    rec.prof = profiled(eng, src, rec.rows, deadline, log)
                    rec.save()
                if group == "beam4" and name == "ours fp16" and device == "cuda":  # beside the throughput one
                    beam = profiled(eng, s, rec.rows, deadline, log, group)
                    if beam:
                        rec.prof = {**(rec.prof or {}), "beam4": beam}
                        rec.save()
        process_rows(a, eng, lines, rec, deadline, log)
        ablation_rows(a, eng, lines, rec, deadline, log)
        chunked_rows(a, eng, lines, rec, deadline, log)
    return rec.rows, rec.prof


def profile_line(prof: dict, group: str = "throughput") -> str:
    """The profile in the log: busy share, kernels and where their time went."""
    top = ", ".join(f"{k['share']:.0%} {k['kernel'][:60]}" for k in prof["top_kernels"])
    named = "" if group == "throughput" else f" {group}"
    return (f"profile    ours fp16{named} batch {_label(prof['batch']):>8}: GPU busy {prof['gpu_busy']:.0%}, "
            f"{prof['kernels']:,} kernels{steps_words(prof)}{idle_words(prof)}{host_words(prof)}; {top}")


def steps_words(prof: dict, per_step: bool = False) -> str:
    """', 168 greedy steps of 4096 rows' (with `per_step`: and the kernels' ms a step); '' where the
    fixed-shape searches did not run."""
    if not prof.get("steps"):
        return ""
    return (f", {prof['steps']:,} {prof.get('loop', 'greedy')} steps of {'/'.join(map(str, prof['rows']))} rows"
            + (f", {1000 * prof['kernel_s'] / prof['steps']:.2f} ms of kernels a step" if per_step else ""))


def host_words(prof: dict) -> str:
    """'; unprofiled, the host first encoded at 95 ms of 740, stepped 102-699 ms' ('' where not measured)."""
    ph = prof.get("host_phases", {})
    if "decode steps" not in ph:
        return ""
    enc, steps = ph.get("encode", ph["decode steps"]), ph["decode steps"]
    return (f"; unprofiled, the host first encoded at {1e3 * enc['first_s']:.0f} ms of "
            f"{1e3 * prof['host_wall_s']:.0f}, stepped {1e3 * steps['first_s']:.0f}-{1e3 * steps['last_s']:.0f} ms")


def idle_words(prof: dict) -> str:
    """'; GPU idle in the profiled pass: 41 ms before its first kernel, ...' ('' where not measured)."""
    if "idle_before_s" not in prof:
        return ""
    return (f"; GPU idle in the profiled pass: {1e3 * prof['idle_before_s']:.0f} ms before its first kernel, "
            f"{1e3 * prof['idle_between_s']:.0f} ms between kernels, {1e3 * prof['idle_after_s']:.0f} ms after its last")


def _label(size) -> str:
    return "default" if size is None else str(size)


# -- the record --------------------------------------------------------------------------------------

def versions() -> dict:
    """GPU, driver, torch, CUDA, CTranslate2 and transformers versions (None where absent)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(p):
        try:
            return version(p)
        except PackageNotFoundError:
            return None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda,
            "ctranslate2": v("ctranslate2"), "transformers": v("transformers")}


def to_markdown(rows: list[dict], summ: dict, prof: dict | None, head: str) -> str:
    md = [head, ""]
    for g in GROUPS:
        ref = best(rows, g, "ct2")
        md += [f"### {g}", "", "| engine | batch | words/s | x CT2 best | BLEU | chrF | graphs captured (host s) |",
               "|---|---:|---:|---:|---:|---:|---:|"]
        for r in (x for x in rows if x["group"] == g):
            how = f" ({r['how']})" if r.get("how") else ""
            if "error" in r:
                md.append(f"| {r['engine']}{how} | {_label(r['batch'])} | {r['error']} | | | | |")
                continue
            mark = "**" if r is best(rows, g, r["engine"]) else ""
            x = ratio(r, ref)
            eager = " (graph capture failed: eager)" if r.get("graphs_failed") else ""
            md.append(f"| {r['engine']}{how}{eager} | {_label(r['batch'])} | {mark}{r['src_words_per_s']:,.0f}{mark} | "
                      f"{'-' if x is None else f'{x:.2f}'} | {r['bleu']:.2f} | {r['chrf']:.2f} | {_captures(r)} |")
        md.append("")
    ratios = ", ".join(f"{SUMMARY_RATIOS[g]} {summ[SUMMARY_RATIOS[g]]}" for g in GROUPS)
    md.append(f"Ours over CTranslate2's best (bold: each engine's best row): {ratios}.")
    for p, what in ((prof, "throughput"), ((prof or {}).get("beam4"), "beam-4")):
        if p and "gpu_busy" in p:
            md += profile_markdown(p, what)
    if prof and "gpu_busy" in prof:
        md += ["", f"{NOT_PROFILED}."]
    return "\n".join(md) + "\n"


def _captures(r: dict) -> str:
    """A row's graph captures a pass and the host's seconds in them; blank for other engines."""
    return f"{r['captures']} ({r['capture_s']:.3f})" if "captures" in r else ""


def profile_markdown(prof: dict, what: str) -> list[str]:
    """A profile's lines: busy share, steps, idle parts, and the GPU time by kernel."""
    md = ["", f"GPU busy, ours at its best {what} row (batch {_label(prof['batch'])}): "
              f"{100 * prof['gpu_busy']:.0f}% ({prof['kernel_s']:.2f} s of CUDA kernels in a "
              f"{prof['wall_s']:.2f} s pass; {100 * prof['busy_under_profiler']:.0f}% of the profiled pass, "
              f"{prof['kernels']:,} kernels" + steps_words(prof, per_step=True).replace(",", ";", 1)
              + idle_words(prof) + host_words(prof) + ")."]
    if prof.get("top_kernels"):
        md += ["", f"GPU time by kernel, that {what} row (share of all kernels' time):", "",
               "| kernel | calls | ms | share |", "|---|---:|---:|---:|"]
        md += [f"| `{k['kernel'][:100]}` | {k['calls']:,} | {k['us'] / 1000:.1f} | {100 * k['share']:.0f}% |"
               for k in prof["top_kernels"]]
    return md


def parse_args(argv=None) -> argparse.Namespace:
    p = cliargs.ArgumentParser(prog="python -m tools.bench_gpu", description=__doc__.split("\n\n")[1],
                               formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    add_test_set_args(p)
    p.add_argument("--beam-lines", type=cliargs.positive_int, default=2000, help="lines of the beam 4 group")
    p.add_argument("--batch1-lines", type=cliargs.positive_int, default=100, help="lines of the batch 1 group")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list of ours, ct2, hf")
    p.add_argument("--ct2-types", default=",".join(CT2_TYPES), metavar="TYPES",
                   help="CTranslate2's compute types, a sweep each (float16 alone: the targets' baseline, and "
                        "on the H200 int8_float16 was slower in every group)")
    p.add_argument("--ablate", default="", metavar="SWITCHES",
                   help="comma list of decoder switches (python -m decoder --list-switches) and settings NAME=VALUE "
                        f"({', '.join(SETTINGS)}), several joined by '+' changed together: for each, ours with the "
                        "switch flipped from its default or the setting so, at our best throughput and batch-1 "
                        "sizes, a row each (a beam search switch, as kv_row_table: at our best beam-4 size)")
    p.add_argument("--chunked", type=cliargs.int_range(0), default=5000, metavar="LINES",
                   help="three more rows of ours at its best throughput size, the text read in chunks of this "
                        "many lines (by default, without short_gil_interval, without decode_ahead), as a run "
                        "longer than one chunk reads it; 0: none")
    p.add_argument("--processes", type=cliargs.int_range(0, 8), default=2, metavar="N",
                   help="one more row of ours at its best throughput size in N processes on the one GPU, each "
                        "a share of the lines (whether a second host fills the GPU's idle time); 0 or 1: none")
    p.add_argument("--time-limit", type=cliargs.positive_float, default=None, metavar="SECONDS",
                   help="start a row only where the slowest row so far of its group and engine (ours' for the "
                        "--ablate and --chunked rows) would still end within this many seconds of the start; the "
                        "others are recorded as not run (a lent GPU's call has a hard limit). Default: none. "
                        "PREFIX.md and PREFIX.json are written after every row either way")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.json (default: "
                                                   "docs/bench/gpu-DATE-GPU)")
    p.add_argument("--summary", metavar="FILE", default=os.path.join("docs", "bench", "summary-gpu.json"),
                   help="the summary JSON")
    a = p.parse_args(argv)
    a.engines = [x.strip() for x in a.engines.split(",") if x.strip()]
    a.ablate = [x.strip() for x in a.ablate.split(",") if x.strip()]
    a.ct2_types = [x.strip() for x in a.ct2_types.split(",") if x.strip()]
    if not a.ct2_types or any(x not in CT2_TYPES for x in a.ct2_types):
        p.error(f"--ct2-types: choose from {', '.join(CT2_TYPES)}, got {','.join(a.ct2_types) or 'none'}")
    for entry in a.ablate:
        try:
            ablation(entry)
        except ValueError as e:
            p.error(f"--ablate: {e}")
    if (a.ablate or a.chunked or a.processes) and "ours" not in a.engines:
        a.chunked = a.processes = 0  # ours' rows only
        if a.ablate:
            p.error("--ablate needs ours among --engines")
    bad = [x for x in a.engines if x not in ENGINES]
    if bad or not a.engines:
        p.error(f"--engines: unknown engine {bad[0]!r}; choose from {', '.join(ENGINES)}" if bad else
                "--engines: none given")
    return a


def check(a) -> str | None:
    """Why this run cannot start (one line), or None."""
    if not torch.cuda.is_available():
        return ("tools.bench_gpu needs a CUDA GPU and torch sees none here; the CPU benchmark is "
                "python -m tools.bench")
    try:
        modeldir.read_config(a.model)
    except modeldir.ModelDirError as e:
        return str(e)
    for engine, module in (("ct2", "ctranslate2"), ("hf", "transformers")):
        if engine in a.engines:
            try:
                __import__(module)
            except ImportError:
                return f"--engines {engine} needs {module} (pip install {module}), or leave {engine} out of --engines"
    return None


def main(argv=None) -> int:
    a = parse_args(argv)
    why = check(a)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        src, ref = read_test_set(a)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hw, ver = machine.describe(), versions()
    line = f"GPU {ver['gpu']} (driver {ver['driver']}, CUDA {ver['cuda']}); CPU {machine.one_line(hw)}"
    print(line, file=sys.stderr, flush=True)
    about = {"gpu": ver["gpu"], "cpu": hw["cpu"], "date": hw["date"],
             "model": os.path.basename(os.path.abspath(a.model)), "lines": len(src), "versions": ver}
    head = (f"{line}. {len(src)} lines ({sum(len(x.split()) for x in src):,} source words); beam 4 on the first "
            f"{min(a.beam_lines, len(src))}, batch 1 on the first {min(a.batch1_lines, len(src))}; fastest of "
            f"{a.passes} passes a row" + (f"; time limit {a.time_limit:g} s." if a.time_limit else "."))
    slug = re.sub(r"[^a-z0-9]+", "-", (ver["gpu"] or "gpu").lower()).strip("-")
    out = a.out or os.path.join("docs", "bench", f"gpu-{hw['date']}-{slug}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write(rows, prof, complete=False) -> tuple[str, dict]:
        summ = summary(rows, prof and prof.get("gpu_busy"), about)
        md = to_markdown(rows, summ, prof, head if complete else f"{head} {PARTIAL}")
        with open(out + ".md", "w") as fh:
            fh.write(md)
        with open(out + ".json", "w") as fh:
            json.dump({"machine": hw, "versions": ver, "sweeps": SWEEPS, "rows": rows, "profile": prof,
                       "summary": summ, "not_profiled": NOT_PROFILED, "complete": complete}, fh, indent=1, default=str)
        return md, summ
    rows, prof = run_all(a, src, ref, lambda m: print(m, file=sys.stderr, flush=True), write=write)
    md, summ = write(rows, prof, complete=True)
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(a.summary)), exist_ok=True)
    with open(a.summary, "w") as fh:
        json.dump([summ], fh, indent=2)
        fh.write("\n")
    print(f"wrote {out}.md, {out}.json, {a.summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cliargs.run(main))
