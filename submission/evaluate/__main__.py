"""python -m submission.evaluate: BLEU/chrF against words/s for every system, one chart.

Systems: each --model/--teacher dir x --engines x --precision x --beam x --threads x
--mode, plus the container (--container IMAGE, or `build` to build it from the first
model dir) in each --container-hardware mode. Without --model/--teacher: every model
`make distill` linked under runs/*/. Test set: the embedded Bible test split (default),
--src/--ref files, or a sacreBLEU test set (-t wmt22 -l en-de, needs the network once).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from decoder import cliargs, fileerrors
from decoder.cliargs import (BEAM_MAX_TOKENS, GPU_MAX_TOKENS, MAX_BEAM, MAX_THREADS, MAX_TOKENS, float_range, int_list,
                             nonneg_int, positive_float, positive_int)

from .systems import EvalError


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


class _Help(cliargs.HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help, and the epilog's lines as written."""


def parser() -> argparse.ArgumentParser:
    ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = cliargs.ArgumentParser(prog="python -m submission.evaluate", description=__doc__.split("\n\n")[0],
                               epilog=__doc__.split("\n\n", 1)[1], formatter_class=_Help)
    cliargs.add_version(p)
    g = p.add_argument_group("systems")
    g.add_argument("--model", action="append", default=[], metavar="[NAME=]DIR",
                   help="a model dir to measure (repeatable); NAME labels it")
    g.add_argument("--teacher", action="append", default=[], metavar="DIR",
                   help="the teacher's model dir (= --model teacher=DIR)")
    g.add_argument("--engines", default="decoder,ct2,hf",
                   help="comma list of decoder (ours), ct2 (CTranslate2), hf (transformers M2M100); "
                        "ct2/hf run the same weights converted (default: all three)")
    g.add_argument("--precision", default="auto,int8",
                   help="comma list of auto,fp32,bf16,int8,fp16 (auto: int8 on CPU where it pays, else fp32; "
                        "fp16 on CUDA); HF always runs fp32; precisions a device cannot run are left out")
    cliargs.alias(g, "--beam", g.add_argument(
        "--beam-size", dest="beam", type=int_list(1, MAX_BEAM), default="1", metavar="N[,N...]",
        help="comma list of beam sizes (1 = greedy)"))
    g.add_argument("--threads", type=int_list(1, MAX_THREADS), default=str(len(os.sched_getaffinity(0))),
                   help="comma list of thread counts")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--mode", default="throughput", choices=["throughput", "latency", "both"],
                   help="latency: one sentence at a time, p50/p90/p99 per sentence")
    g.add_argument("--container", metavar="IMAGE|build",
                   help="measure this image through /run.sh; `build` builds it from the first model dir")
    g.add_argument("--container-hardware", default="CPU-1,CPU-ALL", help="comma list of /run.sh modes")
    # docker refuses a quota below 0.01 or above the host's CPUs, after the image is built
    g.add_argument("--container-cpus", type=float_range(0.01, float(os.cpu_count() or 1)),
                   default=float(len(os.sched_getaffinity(0))), help="CPU quota of CPU-ALL and GPU runs (CPU-1 gets 1)")
    g.add_argument("--container-memory", default="2g", help="memory limit of the container runs")
    t = p.add_argument_group("test set")
    t.add_argument("--src", help="source file (one sentence per line)")
    t.add_argument("--ref", action="append", default=[], help="reference file (repeatable: several references)")
    t.add_argument("-t", "--test-set", help="a sacreBLEU test set, e.g. wmt22")
    t.add_argument("-l", "--langpair", help="its language pair, e.g. en-de (with --src/--ref: the pair on the "
                                            "chart; default: the files' suffixes, test.en/test.es)")
    t.add_argument("--lines", type=nonneg_int, default=0, help="use the first N lines only (0 = all)")
    m = p.add_argument_group("measurement")
    cliargs.alias(m, "--repeats", m.add_argument(
        "--passes", type=positive_int, default=3, help="timed passes per system (median and spread)"))
    m.add_argument("--warmup-lines", type=nonneg_int, default=100, help="lines of the untimed-for-words/s warm-up pass")
    m.add_argument("--latency-lines", type=nonneg_int, default=200, help="lines in latency mode (0 = all)")
    cliargs.alias(m, "--max-tokens", m.add_argument(
        "--max-batch-tokens", dest="max_tokens", type=positive_int, default=None, metavar="N",
        help=f"padded source tokens per batch (default on CPU: ours {MAX_TOKENS} greedy and {BEAM_MAX_TOKENS} with a "
             f"beam, CTranslate2 {MAX_TOKENS}; on CUDA both {GPU_MAX_TOKENS} / beam size)"))
    m.add_argument("--timeout", type=positive_float, default=None, help="seconds one local system may take")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "evaluate"), help="output dir")
    p.add_argument("--replot", metavar="SUMMARY", help="measure nothing: draw the charts again from a "
                   "summary.jsonl/.csv into --out")
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


PRECISIONS = ("auto", "fp32", "bf16", "int8", "fp16")
MEMORY = re.compile(r"[0-9]+([kmg]b?|b)?", re.IGNORECASE)  # docker's --memory: 2g, 512m, 1024000000


def options(argv) -> argparse.Namespace:
    """The parsed options, checked against what the run can do before anything is measured
    or built (names in the comma lists, the test set's options together); a bad one is one
    `error:` line and exit 2 (SystemExit), as argparse's own errors."""
    a = parse_args(argv)
    try:
        check(a)
    except EvalError as e:
        cliargs.refuse(e)
    return a


def check(a) -> None:
    from .systems import ENGINES, HARDWARE
    for option, noun, given, known in (("--engines", "engine", a.engines, ENGINES),
                                       ("--precision", "precision", a.precision, PRECISIONS),
                                       ("--container-hardware", "container hardware", a.container_hardware, HARDWARE)):
        bad = [x for x in _list(given) if x not in known] or ([] if _list(given) else [given])
        if bad:
            raise EvalError(f"{option}: unknown {noun} {bad[0]!r} (choose from {', '.join(known)})")
    if not MEMORY.fullmatch(a.container_memory):
        raise EvalError(f"--container-memory {a.container_memory!r}: a size such as 2g or 512m")
    if why := cliargs.out_dir_error("--out", a.out):  # written after every system has been measured
        raise EvalError(why)
    if a.replot:
        return
    pair = a.langpair.split("-", 1) if a.langpair else []
    if a.langpair and (len(pair) != 2 or not all(pair)):
        raise EvalError(f"-l/--langpair {a.langpair!r} is not SRC-TGT (e.g. en-de)")
    if a.test_set:
        if not a.langpair:
            raise EvalError("-t/--test-set needs -l/--langpair")
        if a.src or a.ref:
            raise EvalError("give either --src/--ref or -t/-l, not both")
    elif a.src or a.ref:
        if not (a.src and a.ref):
            raise EvalError("--src and --ref go together")
        for flag, path in (("--src", a.src), *(("--ref", r) for r in a.ref)):
            if why := cliargs.file_error(flag, path):
                raise EvalError(why)
    elif a.langpair:
        raise EvalError("-l/--langpair goes with -t/--test-set or --src/--ref")


def build_systems(a):
    from .systems import System, container_systems, default_models, grid, parse_named_dir
    ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    models = [parse_named_dir(x) for x in a.model] + [parse_named_dir("teacher=" + x, "--teacher") for x in a.teacher]
    if not models and a.container in (None, "build"):
        models = default_models(ROOT)
        if not models:
            raise EvalError("no models given and none under runs/*/ (make distill, or --model DIR)")
        from decoder.modeldir import ModelDirError, read_config
        for name, path in models:
            try:
                read_config(path)
            except ModelDirError as e:
                raise EvalError(f"{name}: {e}") from None
    modes = ["throughput", "latency"] if a.mode == "both" else [a.mode]
    beams, threads = a.beam, a.threads  # lists of ints, checked by argparse
    engines = _list(a.engines)
    if "ct2" in engines:
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            print("note: ctranslate2 is not installed; no CTranslate2 rows", file=sys.stderr)
            engines.remove("ct2")
    systems: list[System] = grid(models, engines, _list(a.precision), beams, threads, modes, a.device)
    if a.container:
        image, name = a.container, a.container
        if image == "build":
            if not models:
                raise EvalError("--container build needs a --model DIR to bake in")
            from submission.image import build
            image, name = build(models[0][1], quiet=True), models[0][0]
        systems += container_systems(image, name, _list(a.container_hardware), modes, a.container_cpus)
    if not systems:
        raise EvalError("nothing to measure: no engine can run the precisions asked for on this device")
    return systems, models


def load_testset(a, models):
    """The test set the options name (check() has refused every bad combination)."""
    from . import testsets
    pair = a.langpair.split("-", 1) if a.langpair else [None, None]
    if a.test_set:
        ts = testsets.sacrebleu_set(a.test_set, a.langpair)
    elif a.src or a.ref:
        ts = testsets.from_files(a.src, a.ref, *pair)
    else:
        from decoder.modeldir import read_config
        vocab = read_config(models[0][1]).arch.vocab_size if models else 8000
        ts = testsets.embedded(vocab)
    return ts.head(a.lines)


@fileerrors.one_line
def main(argv=None) -> int:
    try:
        a = options(argv)
    except cliargs.Refused:
        return 2
    from . import evaluate, replot
    if a.replot:
        try:
            paths = replot(a.replot, a.out)
        except (EvalError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("wrote " + " ".join(paths), file=sys.stderr)
        return 0
    try:
        systems, models = build_systems(a)
        ts = load_testset(a, models)
        summaries = evaluate(systems, ts, a.out, repeats=a.passes, warmup_lines=a.warmup_lines,
                             latency_lines=a.latency_lines, max_tokens=a.max_tokens,
                             mem_limit=a.container_memory, timeout=a.timeout)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(a.out, "results.md"), encoding="utf-8") as fh:
        print(fh.read())
    print(f"wrote {a.out}/{{results.md,summary.jsonl,summary.csv,measurements.jsonl,measurements.csv,"
          f"pareto.png}}", file=sys.stderr)
    failed = [s for s in summaries if s.get("error")]
    return 1 if failed else 0


def cli() -> int:
    """`python -m submission.evaluate` and the `wmt-kit-evaluate` console script."""
    return cliargs.run(main)  # `| head` on the report ends quietly


if __name__ == "__main__":
    sys.exit(cli())
