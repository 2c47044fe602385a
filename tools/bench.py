"""Ablation benchmark: naive PyTorch -> each optimisation in turn -> HF and CTranslate2
on the same weights (TenTrans-style table), in three groups compared with CTranslate2
at its best: throughput (all cores, greedy), batch 1 (one thread, one sentence a call)
and beam 4.

    python -m tools.bench --model DIR [--input FILE --ref FILE] [--threads N] [--isa native,avx2]

Every row translates the same lines end to end (normalise, SPM, search, detokenise).
CTranslate2 runs as its performance guide advises (tools/baselines.py: int8, parallel
1-thread workers, token batches, vmap from our shortlist) and with every sentence
capped as our decoder caps it. The fastest CT2 row of a group is the denominator of
the group's ratio. Then each group's best row of each engine is timed again, both
loaded side by side and their passes alternating ("head to head": rows timed one
after the other each meet whatever else the machine is doing then), and the group's
ratio is taken from those two rows. Writes <prefix>.md and .json per ISA family, and
summary.json (one object per ISA family: our best words/s over CT2's best, per group).
`--isa avx2` on an AVX-512 machine re-runs every engine in a child process with the ISA
capped (CAPPED), our own C++ kernels included (DECODER_MAX_CPU_ISA; each of our rows records
the ISA they ran, `our_kernels_isa`).
A model dir with a lexical shortlist (python -m student.shortlist) adds the
"+ lexical shortlist" rows beside the same rows without it, and CT2 rows with use_vmap.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime, timezone

import torch
from safetensors import safe_open

from decoder import cliargs, fileerrors, modeldir, ops, textio
from decoder.cliargs import BEAM_MAX_TOKENS, MAX_TOKENS, nonneg_int, positive_int
from decoder.machine import cpu_info, ct2_isa, has_native_bf16
from decoder.optimisations import all_off, defaults, describe, group
from decoder.quant import fbgemm_available, int_mm_vnni
from decoder.translator import Translator, default_precision

from . import bench_chart
from .baselines import CT2Run, _text, alternating, ct2_runs, ct2_translator, fastest, run_ct2, run_hf
from .bench_groups import GROUPS, SUMMARY_RATIOS, group_best, group_ratios, head_to_head_rows
from .convert import to_ctranslate2
from .naive import NaiveTranslator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(ROOT, "tests", "fixtures", "bible-tiny")


def read(path: str) -> list[str]:
    return textio.read_file(path)  # the kit's one reader: b"\n" only, as the decoder reads


def add_test_set_args(p) -> None:
    """The test-set options the interleaved benches (bench_fused, bench_gpu) share."""
    p.add_argument("--model", required=True)
    p.add_argument("--src", default=os.path.join(DEFAULT_DATA, "test.en"), help="source lines")
    p.add_argument("--ref", default=None, help="reference lines (default: --src with .es for .en)")
    p.add_argument("--lines", type=nonneg_int, default=0, help="first N lines only (0 = all)")
    p.add_argument("--passes", type=positive_int, default=3, help="timed passes; the fastest counts")


def read_test_set(a) -> tuple[list[str], list[str]]:
    """(source lines, reference lines) of add_test_set_args' options."""
    ref_path = a.ref or a.src[:-3] + ".es"
    cliargs.refuse_missing(a.model, src=a.src, ref=ref_path)
    src, ref = aligned(a.src, ref_path)
    return (src[:a.lines], ref[:a.lines]) if a.lines else (src, ref)


def aligned(src_path: str, ref_path: str) -> tuple[list[str], list[str]]:
    """Both files' lines, or one error line where their counts differ: every line would be
    scored against another line's reference."""
    src, ref = read(src_path), read(ref_path)
    if len(ref) != len(src):
        cliargs.refuse(f"--ref {ref_path} has {len(ref)} lines but --src {src_path} has {len(src)}")
    return src, ref


def scores(hyps, refs) -> tuple[float, float]:
    import sacrebleu
    return (round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
            round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2))


# -- engines: each returns (hypotheses, seconds) for the whole input ------------------------

@contextmanager
def ours_go(model_dir, threads, batch1: bool = False, **kw):
    """Loaded once: translate(lines) -> hypotheses. batch1: one call per sentence, as a latency
    client (and CT2's batch-1 row) sends them. On exit the worker processes, if any, are
    stopped and waited for: left to the garbage collector, a pool of one row was seen
    exiting (a worker at 93% of a core) while a later row was timed, at a fifth of its speed."""
    make = NaiveTranslator if kw.get("naive") else Translator  # the ladder's first row: no K/V cache
    kw = {k: v for k, v in kw.items() if k != "naive"}
    tr = make(model_dir, threads=threads, **({**kw, "max_sentences": 1, "pipeline": False} if batch1 else kw))

    def go(ls):
        # torch shares its OpenMP pool with CTranslate2, whose Translator(intra_threads=1) set
        # it to one thread for this process: ours at 2 threads in a head-to-head ran on one
        torch.set_num_threads(threads)
        return [tr.translate([x])[0] for x in ls] if batch1 else tr.translate(ls)
    go.translator = tr  # for what a row records of how it ran (tools/bench_gpu.py timed)
    try:
        yield go
    finally:
        tr.close()


def run_ours(model_dir, lines, threads, passes: int = 1, batch1: bool = False, **kw):
    """(outputs, seconds): the fastest of `passes` timed passes after a warm-up."""
    with ours_go(model_dir, threads, batch1, **kw) as go:
        return fastest(go, lines, passes)


def run_head_to_head(model_dir, ct2_dir, lines, ours: tuple[int, bool, dict], run: CT2Run, passes: int = 1):
    """((outputs, seconds) of ours, (outputs, seconds) of CT2): `ours` (threads, batch1,
    settings) and `run` loaded side by side, their passes alternating (baselines.alternating)."""
    threads, batch1, kw = ours
    with ours_go(model_dir, threads, batch1, **kw) as go:
        return tuple(alternating([go, ct2_translator(ct2_dir, model_dir, run)], lines, passes))


# -- the table -------------------------------------------------------------------------------

NAIVE = dict(all_off(), beam=4, precision="fp32")  # every switch of decoder/optimisations.py off


def ablation() -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(cumulative fp32 rows, variant rows), generated from the registry. Each
    cumulative row adds one "ladder" optimisation to the previous one; each
    variant is the last cumulative row with one precision change or one fused
    kernel, so the table shows what each does on this CPU (on an AVX2-only CPU
    int8 and bf16 are slower than fp32) and the best configuration is picked by
    measurement, not assumed."""
    rows, cur = [("naive PyTorch (beam 4, no cache, unsorted, fp32)", dict(NAIVE, naive=True))], dict(NAIVE)
    rows.append(("+ K/V cache, cross K/V once per sentence", dict(cur)))  # decoder/state.py against tools/naive.py
    for o in group("ladder"):
        cur = {**cur, o.name: True, **o.row}
        rows.append((f"+ {o.label}", dict(cur)))
    variants = [("+ bf16 weights and activations", {**cur, "precision": "bf16"}),
                ("+ int8 dynamic (PyTorch ops)", {**cur, "precision": "int8"})]
    variants += [(f"+ int8 dynamic, {o.label}", {**cur, "precision": "int8", **o.row, o.name: True}) for o in group("int8")]
    step = group("step")
    variants += [(f"+ {o.label}", {**cur, o.name: True}) for o in step]
    variants.append((f"+ all of {', '.join(o.name for o in step)}", {**cur, **{o.name: True for o in step}}))
    variants += [(f"+ {o.label}", {**cur, **o.row, o.name: True}) for o in group("greedy")]
    return rows, variants


def beam_rows(best: dict) -> list[tuple[str, dict]]:
    """Beam 4 from the best greedy configuration, then each beam kernel added in turn."""
    tag, cur = describe(best), {**best, "beam": 4}
    rows = [(f"best ({tag}), beam 4", dict(cur))]
    for o in group("beam"):
        cur = {**cur, o.name: True}
        rows.append((f"best ({tag}), beam 4, + {o.label}", dict(cur)))
    return rows


def batch1_rows(best: dict) -> list[tuple[str, dict]]:
    """Batch 1 from the best greedy configuration with every one-row lever
    ("batch1" in decoder/optimisations.py) off, then each added in turn; in int8
    then each int8 kernel the throughput winner left off (the few-row kernel
    pays at one row, not in batches): the last row has them all."""
    cur = {**best, **{o.name: False for o in group("batch1")}}
    rows = [("one-row levers off", dict(cur))]
    more = [o for o in group("int8") if best.get("precision") == "int8" and not best.get(o.name)]
    for o in group("batch1") + more:
        cur = {**cur, **o.row, o.name: True}
        rows.append((f"+ {o.label}", dict(cur)))
    return rows


def defaults_row() -> tuple[str, dict]:
    """The decoder as shipped: every switch at its registry default, at the CPU's default
    precision (decoder/translator.py `default_precision`, decided there once: int8 where this
    CPU has an int8 kernel). Not the fastest ablation variant's: an ablation row timed on a
    subset (`slow_here`) is no candidate, and on AVX2 that left the shipped row fp32."""
    prec = default_precision("cpu")
    return f"the decoder's defaults, {prec}", {**defaults(), "beam": 1, "precision": prec}


def compose(measured: dict[str, tuple[float, dict]], plain: dict) -> tuple[str, dict] | None:
    """The precision variant that ran fastest, with every step and greedy kernel
    that beat the plain fp32 row alone: the ablation measures each change on its
    own, so without this row no measured configuration combines int8 with the
    kernels. `measured`: {row name: (words/s, config)} of whole-input greedy rows;
    `plain` the last fp32 ladder row's config. None if a row is missing."""
    base = measured.get(f"+ {ladder_label(plain)}")
    precs = [(w, kw) for n, (w, kw) in measured.items() if kw.get("precision", "fp32") != "fp32"]
    if base is None or not precs:
        return None
    _, prec = max(precs, key=lambda r: r[0])
    paid = [o for o in group("step") + group("greedy")
            if measured.get(f"+ {o.label}", (0.0, None))[0] > base[0]]
    kw = {**prec, **{o.name: True for o in paid}}
    return f"+ {describe(prec)}, with the kernels that paid alone ({', '.join(o.name for o in paid) or 'none'})", kw


def ladder_label(kw: dict) -> str:
    """The label of the last ladder optimisation switched on in kw (its cumulative row's name)."""
    return [o.label for o in group("ladder") if kw.get(o.name)][-1]


def pick_best(rows: list[tuple[float, float | None, dict]], max_bleu_loss: float = 0.2) -> dict:
    """The fastest of (words/s, BLEU, config) greedy rows that stays within
    `max_bleu_loss` BLEU of the best-optimised fp32 row (the last fp32 one)."""
    fp32 = [b for _, b, kw in rows if kw["precision"] == "fp32" and b is not None]
    ok = [r for r in rows if not fp32 or r[1] is None or r[1] >= fp32[-1] - max_bleu_loss]
    return max(ok, key=lambda r: r[0])[2]


def slow_here(kw: dict, flags: list[str]) -> bool:
    """A precision this CPU runs far slower than fp32: time it on a subset only. int8: `_int_mm`
    without VNNI is a plain loop, 13-30x slower than fp32 (decoder/quant.py)."""
    if kw.get("precision") == "int8":
        return not (int_mm_vnni() or (kw.get("fbgemm_int8", True) and fbgemm_available()))
    if kw.get("precision") == "bf16":
        return not has_native_bf16(flags)
    return False


# the AVX2-capped pass: set before torch, oneDNN, CTranslate2 and our C++ ops load, so only in a fresh
# process; fbgemm (torch's quantized int8 ops) dispatches on its own cpuinfo: FBGEMM_ENABLE_INSTRUCTIONS caps
# it; our own kernels (decoder/csrc) read DECODER_MAX_CPU_ISA (decoder/ops.py ISA_CAP)
CAPPED = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "CT2_FORCE_CPU_ISA": "AVX2",
                   "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", ops.ISA_CAP: "avx2"}}


def our_kernels_isa() -> str:
    """The ISA our C++ kernels run in this process (and its workers): ops.kernel_isa(), or
    "none" where the ops are not loaded (every op then runs its PyTorch reference)."""
    return ops.kernel_isa() if ops.available() else "none"


SKIPPABLE = ("naive", "ablation", "hf", "ct2", "batch1", "beam", "h2h")  # --skip's names
# CT2_FORCE_CPU_ISA -> the CPU flag it needs (cpu_info lists no plain avx: every AVX2 CPU has it)
CT2_ISAS = {"GENERIC": None, "AVX": "avx2", "AVX2": "avx2", "AVX512": "avx512f"}


def parse_args(argv=None) -> argparse.Namespace:
    p = cliargs.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0],
                               formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    p.add_argument("--model", default=os.path.join(DEFAULT_DATA, "model"))
    cliargs.alias(p, "--input", p.add_argument(
        "--src", default=None, help="source lines (default: test.en next to the model: the Bible test split "
                                    "of tests/fixtures/bible-tiny)"))
    p.add_argument("--ref", default=None, help="reference lines for BLEU/chrF (default: test.es next to the "
                                               "model when --src is not given)")
    p.add_argument("--lines", type=nonneg_int, default=0, help="use the first N lines (0 = all)")
    cliargs.alias(p, "--repeat", p.add_argument(
        "--repeat-input", dest="repeat", type=positive_int, default=1, metavar="K",
        help="synthetic larger input: the input K times"))
    p.add_argument("--passes", type=positive_int, default=1,
                   help="timed passes per configuration (ours and CT2); the fastest counts (noise on shared "
                        "machines)")
    p.add_argument("--naive-lines", type=nonneg_int, default=100,
                   help="the naive rows are slow: time them on the first N lines only")
    p.add_argument("--batch1-lines", type=positive_int, default=100,
                   help="the batch-1 group translates the first N lines, one per call")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                   help="cores for the throughput and beam-4 groups (default: all of this machine's)")
    cliargs.alias(p, "--max-tokens", p.add_argument(
        "--max-batch-tokens", dest="max_tokens", type=positive_int, default=None, metavar="N",
        help=f"our padded source tokens per batch (default: {MAX_TOKENS} greedy, {BEAM_MAX_TOKENS} with a "
             "beam); CTranslate2 runs token batches of 4,096 (tools/baselines.py ct2_runs)"))
    p.add_argument("--isa", default="native",
                   help="comma list of ISA families to measure: native (this CPU's best), avx2 (every engine "
                        "capped to AVX2 in a child process; the same as native on an AVX2-only CPU)")
    p.add_argument("--ct2-isa", default=None, type=str.upper,
                   help="CT2_FORCE_CPU_ISA of the native pass (default: best the CPU has)")
    p.add_argument("--skip", default="", help="comma list of: naive, ablation (only the best fp32 row and int8 of "
                                              "ours), hf, ct2, batch1, beam, h2h (the head-to-head reruns of each "
                                              "group's best rows)")
    p.add_argument("--profile", action="store_true",
                   help="also profile the best configuration (top ops) into PREFIX-profile.txt")
    p.add_argument("--out", metavar="PREFIX", default=None,
                   help="write PREFIX.md and PREFIX.json, PREFIX-<isa>.* when several ISA families are measured "
                        "(default: docs/bench/bench-<model dir name>)")
    p.add_argument("--summary", metavar="PATH", default=None,
                   help="the per-ISA ratios (default: summary.json next to --out; 'none' for no file)")
    # the old way to say --out, kept for scripts: --out-dir DIR --name NAME = --out DIR/NAME
    p.add_argument("--name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def out_prefix(a: argparse.Namespace) -> str:
    """--out, or the old --out-dir DIR / --name NAME, or docs/bench/bench-<model dir name>."""
    return a.out or os.path.join(a.out_dir or os.path.join(ROOT, "docs", "bench"),
                                 a.name or f"bench-{os.path.basename(os.path.abspath(a.model))}")


def isa_family(flags: list[str], env=os.environ) -> str:
    """avx512 or avx2: what this process's kernels may use (a capped child says avx2)."""
    if env.get("ATEN_CPU_CAPABILITY") == "avx2":
        return "avx2"
    return "avx512" if "avx512f" in flags else "avx2"


def isa_passes(requested: str, flags: list[str], env=os.environ) -> list[tuple[str, dict | None]]:
    """[(family, env of a capped child or None for this process)], one per family, in order."""
    here, out = isa_family(flags, env), {}
    for name in filter(None, (x.strip() for x in requested.split(","))):
        if name not in ("native", "avx2", "avx512"):
            raise ValueError(f"--isa: unknown ISA family {name!r} (native, avx2)")
        fam = here if name == "native" else name
        if fam == "avx512" and here != "avx512":
            raise ValueError("--isa avx512: this CPU (or capped process) has no AVX-512")
        out.setdefault(fam, None if fam == here else CAPPED[fam])
    if not out:
        raise ValueError("--isa: no ISA family given")
    return list(out.items())


def summary_entry(result: dict) -> dict:
    """One object of summary.json from one ISA pass's JSON."""
    r, m = group_ratios(result["rows"]), result["machine"]
    return {"isa": m["isa"], "cpu": m["cpu"], "date": m["date"], "model": result["model"],
            "model_shape": (result.get("model_facts") or {}).get("shape"),
            "our_kernels_isa": m.get("our_kernels_isa"), **{SUMMARY_RATIOS[g]: r[g] for g in GROUPS}}


def shown_path(path: str) -> str:
    """A path as the tables may show it: relative to the repository or the working dir
    when inside one, else its last two parts (never a machine's absolute path)."""
    p = os.path.abspath(path)
    for base in (ROOT, os.getcwd()):
        if p.startswith(base.rstrip(os.sep) + os.sep):
            return os.path.relpath(p, base)
    return os.path.join(*p.split(os.sep)[-2:])


def model_facts(model_dir: str) -> dict:
    """What was measured: the model's shape and size, its preset, its shortlist."""
    cfg = modeldir.read_config(model_dir)
    a = cfg.arch
    with safe_open(os.path.join(model_dir, modeldir.WEIGHTS), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    shape = (f"d {a.d_model}, {a.n_heads} heads, ffn {a.ffn_dim}, {a.encoder_layers}+{a.decoder_layers} layers, "
             f"vocab {a.vocab_size}, {params / 1e6:.1f}M parameters")
    preset = (cfg.provenance or {}).get("preset")
    return {"shape": f"{preset}: {shape}" if preset else shape, "preset": preset, "params": params,
            "arch": {k: getattr(a, k) for k in ("d_model", "n_heads", "ffn_dim", "encoder_layers",
                                                 "decoder_layers", "vocab_size")},
            "shortlist": os.path.exists(os.path.join(model_dir, modeldir.SHORTLIST))}


@fileerrors.one_line
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    flags = cpu_info()["flags"]
    check_options(a, flags)  # refused here, not in each ISA pass's child
    try:
        passes = isa_passes(a.isa, flags)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    prefix, results = out_prefix(a), []
    for fam, env in passes:
        out = prefix if len(passes) == 1 else f"{prefix}-{fam}"
        if env is None:
            results.append(run_pass(a, out))
            continue
        print(f"ISA pass {fam}: every engine in a child process with "
              f"{' '.join(f'{k}={v}' for k, v in env.items())}", file=sys.stderr, flush=True)
        child = argv + ["--isa", fam, "--out", out, "--summary", "none"]
        rc = subprocess.run([sys.executable, "-m", "tools.bench", *child], cwd=ROOT,
                            env={**os.environ, **env}).returncode
        if rc:
            print(f"error: the {fam} pass failed (exit {rc})", file=sys.stderr)
            sys.exit(rc)
        with open(out + ".json") as fh:
            results.append(json.load(fh))
    summary = a.summary or os.path.join(os.path.dirname(os.path.abspath(prefix)), "summary.json")
    if summary != "none":
        os.makedirs(os.path.dirname(os.path.abspath(summary)), exist_ok=True)  # as --out's folder
        with open(summary, "w") as fh:
            json.dump([summary_entry(r) for r in results], fh, indent=2)
            fh.write("\n")
        print(f"summary: {summary}", file=sys.stderr)
    print(f"chart: {bench_chart.plot(results, prefix + '.png')}", file=sys.stderr)


def pass_machine(a: argparse.Namespace) -> tuple[dict, object]:
    """(what a pass records of its machine and settings, the ctranslate2 module or None). Sets
    CT2_FORCE_CPU_ISA, so before ctranslate2 is imported."""
    machine = cpu_info()
    fam = isa_family(machine["flags"])
    capped = {k: os.environ[k] for k in CAPPED["avx2"] if k in os.environ and "ATEN_CPU_CAPABILITY" in os.environ}
    isa = capped.get("CT2_FORCE_CPU_ISA") or a.ct2_isa or ct2_isa(machine["flags"])
    os.environ["CT2_FORCE_CPU_ISA"] = isa
    torch.set_num_threads(a.threads)
    machine.update(isa=fam, date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   torch=torch.__version__, torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   threads=a.threads, ct2_isa=isa, isa_env=capped, python=platform.python_version(),
                   load_avg_at_start=os.getloadavg()[0], timing_passes=a.passes, our_kernels_isa=our_kernels_isa())
    try:
        import ctranslate2
        machine["ctranslate2"] = ctranslate2.__version__
    except ImportError:
        ctranslate2 = None
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['flags'])}; ISA pass {fam}"
          f"{' (' + ' '.join(f'{k}={v}' for k, v in capped.items()) + ')' if capped else ''}; "
          f"our C++ kernels {machine['our_kernels_isa']}; "
          f"torch {machine['torch']} ({machine['torch_cpu_capability']}), {a.threads} threads, "
          f"CT2 ISA {isa}", file=sys.stderr)
    return machine, ctranslate2


def check_options(a: argparse.Namespace, flags: list[str]) -> None:
    """What the parser cannot see, refused in one error line before any work: the inputs
    (present, as many reference lines as source lines), the outputs' folders, --skip's names,
    a --ct2-isa that CTranslate2 or this CPU cannot run."""
    src_path, ref_path = input_paths(a)
    for flag, path in (("--out", out_prefix(a)), ("--summary", a.summary if a.summary != "none" else None)):
        if path and (why := cliargs.out_dir_error(flag, path, file=True)):
            cliargs.refuse(why)
    if unknown := [x for x in filter(None, a.skip.split(",")) if x not in SKIPPABLE]:
        cliargs.refuse(f"--skip: unknown name {unknown[0]!r} (choose from {', '.join(SKIPPABLE)})")
    if a.ct2_isa is not None and (a.ct2_isa not in CT2_ISAS or CT2_ISAS[a.ct2_isa] not in (None, *flags)):
        runnable = [k for k, f in CT2_ISAS.items() if f is None or f in flags]
        cliargs.refuse(f"--ct2-isa {a.ct2_isa}: not one this CPU runs ({', '.join(runnable)})")
    if ref_path and os.path.exists(ref_path):
        aligned(src_path, ref_path)


def input_paths(a: argparse.Namespace) -> tuple[str, str | None]:
    """(--src, --ref), by default the test split beside the model; one error line if the model dir
    or a file given is not there (test.es may be missing: no BLEU then)."""
    model_base = os.path.dirname(os.path.abspath(a.model))
    src_path = a.src or os.path.join(model_base, "test.en")
    ref_path = a.ref or (os.path.join(model_base, "test.es") if a.src is None else None)
    cliargs.refuse_missing(a.model, src=src_path, ref=a.ref)
    return src_path, ref_path


def pass_input(a: argparse.Namespace) -> tuple[str, list[str], list[str] | None]:
    """(source path, source lines, reference lines or None) of --src/--ref/--lines; by default the
    test split next to the model."""
    src_path, ref_path = input_paths(a)
    src = read(src_path)
    ref = read(ref_path) if ref_path and os.path.exists(ref_path) else None
    if a.lines:
        src, ref = src[:a.lines], ref[:a.lines] if ref else None
    print(f"input: {src_path} ({len(src)} lines x {a.repeat})", file=sys.stderr)
    return src_path, src, ref


class Pass:
    """One ISA pass's rows, group by group, in the table's order: our ablation and the best
    greedy configuration, its workers and shortlist rows, beam 4, batch 1, then HF, CTranslate2
    and the head-to-head reruns."""

    def __init__(self, a: argparse.Namespace, machine: dict, src: list[str], ref: list[str] | None):
        self.a, self.machine = a, machine
        self.lines, self.refs = src * a.repeat, (ref * a.repeat if ref else None)
        self.b1 = src[:a.batch1_lines]
        self.skip = set(filter(None, a.skip.split(",")))
        cfg, self.text = _text(a.model)  # token counting only
        self.has_shortlist = cfg.shortlist is not None  # rows with the switch only where there is a file
        # every core as parallel 1-thread workers: our counterpart of CT2's inter_threads
        self.spread = [("", {})] + ([(f", {a.threads} workers", {"workers": a.threads})] if a.threads > 1 else [])
        self.extra = [(", + lexical shortlist", {"shortlist": True})] if self.has_shortlist else []
        # the rows beside them run without it: the decoder takes the model dir's shortlist by default
        self.bare = {"shortlist": False} if self.has_shortlist else {}
        self.rows: list[dict] = []
        self.settings = {}  # id of each of our rows -> (threads, batch1, settings): the head-to-head reruns one

    def record(self, name, hyps, secs, sub, engine, group=None, **facts):
        words = lambda ls: sum(len(s.split()) for s in ls)  # noqa: E731
        r = {"config": name, "engine": engine, "group": group, **facts, "lines": len(sub),
             "seconds": round(secs, 3), "src_words_per_s": round(words(sub) / secs, 1),
             "out_words_per_s": round(words(hyps) / secs, 1),
             "tgt_tokens_per_s": round(sum(len(x) for x in self.text.sp.encode(hyps)) / secs, 1)}
        if self.refs:
            r["bleu"], r["chrf"] = scores(hyps, self.refs[:len(hyps)])
        self.rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)

    def ours(self, name, sub, group, threads=None, batch1=False, **kw):
        threads = threads or self.a.threads
        hyps, secs = run_ours(self.a.model, sub, threads, self.a.passes, batch1=batch1, max_tokens=self.a.max_tokens,
                              **kw)
        self.record(name + (f" [first {len(sub)} lines]" if len(sub) < len(self.lines) and not batch1 else ""),
                    hyps, secs, sub, "ours", group, precision=kw.get("precision", "fp32"), beam=kw.get("beam", 1),
                    threads=threads, workers=kw.get("workers", 0), shortlist=bool(kw.get("shortlist")),
                    our_kernels_isa=self.machine["our_kernels_isa"])
        self.settings[id(self.rows[-1])] = (threads, batch1, {**kw, "max_tokens": self.a.max_tokens})
        return self.rows[-1]

    def greedy(self) -> tuple[dict, dict, str]:
        """The ablation's rows, the composed and the shipped rows: (best, shipped, best's tag)."""
        a, lines = self.a, self.lines
        cumulative, variants = ablation()
        if "ablation" in self.skip:
            cumulative, variants = cumulative[-1:], [v for v in variants if v[0] == "+ int8 dynamic (PyTorch ops)"]
        full = []  # (words/s, BLEU, kw) of greedy rows timed on the whole input: candidates for "best"
        measured = {}  # {name: (words/s, kw)} of the same rows, for the composed row
        for name, kw in cumulative + variants:
            naive_row = kw.get("naive", False)
            if naive_row and "naive" in self.skip:
                continue
            slow = naive_row or slow_here(kw, self.machine["flags"])
            sub = lines[:a.naive_lines] if slow and a.naive_lines else lines
            whole = len(sub) == len(lines)
            r = self.ours(name, sub, ("throughput" if kw["beam"] == 1 else "beam4") if whole else None, **kw)
            if whole and kw["beam"] == 1:
                full.append((r["src_words_per_s"], r.get("bleu"), kw))
                measured[name] = (r["src_words_per_s"], kw)
        mix = compose(measured, cumulative[-1][1]) if "ablation" not in self.skip else None
        shipped = defaults_row()
        for name, kw in ([mix] if mix else []) + [shipped]:
            r = self.ours(name, lines, "throughput", **kw)
            full.append((r["src_words_per_s"], r.get("bleu"), kw))
        best = pick_best(full)
        tag = f"defaults, {best['precision']}" if best.items() >= defaults().items() else describe(best)
        return best, shipped[1], tag

    def spread_rows(self, best: dict, shipped: dict, tag: str) -> None:
        """The best greedy configuration with workers and the shortlist. It is picked in one process
        with --threads threads; the decoder as shipped may rank differently with one thread per
        worker, so it gets the same rows."""
        cands = [(f"best ({tag})", best)]
        if shipped != best:
            cands.append((f"shipped ({shipped['precision']})", shipped))
        for label, ckw in cands:
            for w, wkw in self.spread[1:]:
                self.ours(f"{label}{w}", self.lines, "throughput", **{**ckw, **wkw, **self.bare})
            for s, skw in self.extra:
                for w, wkw in self.spread:
                    self.ours(f"{label}{w}{s}", self.lines, "throughput", **{**ckw, **wkw, **skw})

    def beam(self, best: dict, shipped: dict, tag: str) -> None:
        """Beam 4 from the best greedy configuration with each beam kernel added in turn; then the
        fastest of those rows within 0.2 BLEU of the first, with workers and the shortlist."""
        a, lines = self.a, self.lines
        timed = []
        for name, kw in beam_rows(best):
            r = self.ours(name, lines, "beam4", **kw)
            timed.append((r["src_words_per_s"], r.get("bleu"), kw))
        ref = timed[0][1]
        bbest = max((r for r in timed if ref is None or r[1] is None or r[1] >= ref - 0.2), key=lambda r: r[0])[2]
        btag = ", ".join([tag] + [o.name for o in group("beam") if bbest.get(o.name)])
        for s, skw in self.spread[1:] + self.extra:
            self.ours(f"best beam ({btag}){s}", lines, "beam4", **{**bbest, **self.bare, **skw})
        if self.has_shortlist and a.threads > 1:
            self.ours(f"best beam ({btag}), {a.threads} workers, + lexical shortlist", lines, "beam4",
                      **{**bbest, "workers": a.threads, "shortlist": True})
        if shipped != best and a.threads > 1:
            for s, skw in [("", {})] + self.extra:
                self.ours(f"shipped ({shipped['precision']}), beam 4, {a.threads} workers{s}", lines, "beam4",
                          **{**shipped, "beam": 4, "workers": a.threads, **self.bare, **skw})

    def batch1(self, best: dict, shipped: dict, tag: str) -> None:
        """One thread, one sentence a call: the one-row levers' ladder, then best and shipped."""
        *ladder, (_, b1best) = batch1_rows(best)
        for name, kw in ladder:
            self.ours(f"batch 1, 1 thread: ours {tag} greedy, {name}", self.b1, "batch1", threads=1, batch1=True, **kw)
        for s, skw in [("", {})] + self.extra:
            self.ours(f"batch 1, 1 thread: ours {tag} greedy{s}", self.b1, "batch1", threads=1, batch1=True,
                      **{**b1best, **self.bare, **skw})
            if shipped != b1best:
                self.ours(f"batch 1, 1 thread: ours shipped ({shipped['precision']}) greedy{s}", self.b1, "batch1",
                          threads=1, batch1=True, **{**shipped, **self.bare, **skw})

    def ct2(self) -> None:
        """CTranslate2 as its guide advises, each group; then the head-to-head reruns."""
        skipped = {"batch1": "batch1", "beam4": "beam"}  # group -> its --skip name
        groups = [g for g in GROUPS if skipped.get(g) not in self.skip]
        with tempfile.TemporaryDirectory() as tmp:
            ct2_dir = to_ctranslate2(self.a.model, os.path.join(tmp, "ct2"))
            for g in groups:
                # CT2 keeps its own 4096-token batches: it ran within 1% from 512 to 4096 tokens
                # (decoder/README.md "Settings"), where ours is faster at MAX_TOKENS
                runs = ct2_runs(g, self.a.threads, vmap=self.has_shortlist)
                if g == "throughput":  # the float32 reference row: same weights, no quantisation
                    runs.append(CT2Run("float32", inter_threads=self.a.threads))
                for run in runs:
                    sub = self.b1 if run.batch1 else self.lines
                    hyps, secs = run_ct2(ct2_dir, self.a.model, sub, run, self.a.passes)
                    self.record(run.label(), hyps, secs, sub, "ct2", g, precision=run.compute_type, beam=run.beam,
                                ct2=asdict(run))
            if "h2h" not in self.skip:
                for g in groups:
                    self.head_to_head(g, ct2_dir)

    def head_to_head(self, g: str, ct2_dir: str) -> None:
        """The group's best row of each engine timed again, side by side (run_head_to_head)."""
        o, c = group_best(self.rows, g, "ours"), group_best(self.rows, g, "ct2")
        if o is None or c is None:
            return
        spec = self.settings[id(o)]
        sub = self.b1 if spec[1] else self.lines
        (oh, osec), (ch, csec) = run_head_to_head(self.a.model, ct2_dir, sub, spec, CT2Run(**c["ct2"]), self.a.passes)
        self.record(f"head to head: {o['config']}", oh, osec, sub, "ours", g, h2h=True,
                    **{k: o[k] for k in ("precision", "beam", "threads", "workers", "shortlist", "our_kernels_isa")})
        self.record(f"head to head: {c['config']}", ch, csec, sub, "ct2", g, h2h=True, precision=c["precision"],
                    beam=c["beam"], ct2=c["ct2"])


def run_pass(a: argparse.Namespace, out: str) -> dict:
    """Every row on this process's ISA; writes out.md, out.json; returns the JSON."""
    machine, ctranslate2 = pass_machine(a)
    src_path, src, ref = pass_input(a)
    p = Pass(a, machine, src, ref)
    best, shipped, tag = p.greedy()
    machine["best_config"] = dict(best)
    p.spread_rows(best, shipped, tag)
    if "beam" not in p.skip:
        p.beam(best, shipped, tag)
    if "batch1" not in p.skip:
        p.batch1(best, shipped, tag)
    if "hf" not in p.skip:
        torch.set_num_threads(a.threads)
        hyps, secs = run_hf(a.model, p.lines, a.threads)
        p.record("HF transformers M2M100, greedy, fp32", hyps, secs, p.lines, "hf", "throughput", precision="fp32")
    if ctranslate2 is not None and "ct2" not in p.skip:
        p.ct2()
    profile = profile_best(a.model, p.lines, a.threads, a.max_tokens, best) if a.profile else None
    add_ratios(p.rows)
    machine["load_avg_at_end"] = os.getloadavg()[0]
    result = {"machine": machine, "input": shown_path(src_path), "lines": len(src), "repeat": a.repeat,
              "model": shown_path(a.model), "model_facts": model_facts(a.model), "ratios": group_ratios(p.rows),
              "rows": p.rows}
    write_pass(out, result, profile)
    return result


def write_pass(out: str, result: dict, profile: str | None) -> None:
    """out.md (also printed), out.json and out-profile.txt of one pass."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    md = to_markdown(result["rows"], result["machine"], result["input"], result["lines"], result["repeat"],
                     result["model"], result["ratios"])
    with open(out + ".md", "w") as fh:
        fh.write(md)
    with open(out + ".json", "w") as fh:
        json.dump(result, fh, indent=2)
    if profile:
        with open(out + "-profile.txt", "w") as fh:
            fh.write(profile)
    print(md)


def add_ratios(rows: list[dict]) -> None:
    """x naive (first row, when it is the naive one) and x CT2 best of the row's group."""
    naive = rows[0] if rows and rows[0]["config"].startswith("naive") else None
    ct2 = {g: group_best(rows, g, "ct2") for g in GROUPS}
    for r in rows:
        if naive:
            r["x_naive"] = round(r["src_words_per_s"] / naive["src_words_per_s"], 2)
        # a head-to-head row against its CT2 twin of the same passes
        best = (head_to_head_rows(rows, r["group"]) or (None, None))[1] if r.get("h2h") else ct2.get(r.get("group"))
        if best:
            r["x_ct2_best"] = round(r["src_words_per_s"] / best["src_words_per_s"], 2)


class Timeline:
    """The host's clock through a Translator's `phase` hook: each phase's first entry and last exit
    after `start`, and the seconds spent inside it (threads of the pipeline may overlap)."""

    def __init__(self, clock=time.perf_counter):
        self.clock, self.start, self.spans = clock, clock(), {}

    @contextmanager
    def phase(self, name: str):
        t = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            first, last, inside = self.spans.get(name, (t, end, 0.0))
            self.spans[name] = (min(first, t), max(last, end), inside + end - t)

    @property
    def seconds(self) -> dict[str, float]:
        """{phase: seconds spent inside it}."""
        return {name: inside for name, (_, _, inside) in self.spans.items()}

    def summary(self) -> dict:
        """{phase: {first_s, last_s, inside_s}}, offsets from `start`."""
        return {name: {"first_s": round(a - self.start, 4), "last_s": round(b - self.start, 4),
                       "inside_s": round(inside, 4)} for name, (a, b, inside) in self.spans.items()}


def profile_best(model_dir, lines, threads, max_tokens, best: dict) -> str:
    """Where the time of the best configuration goes: phases, then ops."""
    tr = Translator(model_dir, threads=threads, **{**best, "max_tokens": max_tokens, "pipeline": False})
    tr.translate(lines[:8])
    phases = Timeline()
    tr.phase = phases.phase
    t = time.perf_counter()
    tr.translate(lines)
    total = time.perf_counter() - t
    tr.phase = Translator.phase
    with torch.profiler.profile() as prof:
        tr.translate(lines)
    out = [f"best configuration ({best['precision']} greedy), {len(lines)} lines, {threads} threads: {total:.3f} s"]
    for k, v in phases.seconds.items():
        out.append(f"  {k:14s} {v:7.3f} s  {100 * v / total:5.1f}%")
    out.append(f"  {'rest':14s} {total - sum(phases.seconds.values()):7.3f} s  (search bookkeeping, text, batching)")
    out.append("")
    out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return "\n".join(out) + "\n"


def ratio_list(ratios: dict) -> str:
    return ", ".join(f"{g} {'-' if v is None else f'{v:.2f}x'}" for g, v in ratios.items())


def to_markdown(rows, machine, src_path, n, repeat, model, ratios) -> str:
    apart = (" Groups with head-to-head rows take them (the two best configurations loaded side by side, their "
             f"passes alternating); as the best rows were timed one after the other: "
             f"{ratio_list(group_ratios(rows, False))}." if any(r.get("h2h") for r in rows) else "")
    cols = [("config", "configuration"), ("group", "group"), ("src_words_per_s", "src words/s"),
            ("out_words_per_s", "output words/s"), ("bleu", "BLEU"), ("chrf", "chrF"), ("x_naive", "x naive"),
            ("x_ct2_best", "x CT2 best of group"), ("our_kernels_isa", "our kernels' ISA")]
    env = " ".join(f"{k}={v}" for k, v in machine.get("isa_env", {}).items())
    out = [f"Machine: {machine['cpu']}, {machine['cores']} cores, flags: {' '.join(machine['flags'])}; "
           f"ISA pass {machine['isa']}{' (' + env + ')' if env else ''}; "
           f"our C++ kernels {machine.get('our_kernels_isa', '-')}; "
           f"torch {machine['torch']} ({machine['torch_cpu_capability']}), {machine['threads']} threads; "
           f"CTranslate2 {machine.get('ctranslate2', '-')} with CT2_FORCE_CPU_ISA={machine['ct2_isa']}; "
           f"load average {machine['load_avg_at_start']:.1f} at start, {machine['load_avg_at_end']:.1f} at end.",
           f"Model: `{model}`. Input: `{src_path}` ({n} lines x {repeat}).", "",
           f"Our best / CTranslate2's best, source words/s: {ratio_list(ratios)}." + apart, "",
           "| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(k) if r.get(k) is not None else "") for k, _ in cols) + " |")
    return "\n".join(out) + "\n"

if __name__ == "__main__":
    main()
