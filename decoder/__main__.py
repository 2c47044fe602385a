"""python -m decoder --model DIR [--beam N] [--device cpu|cuda] [--precision ...] [--shortlist] < in > out

Reads stdin incrementally as bytes (invalid UTF-8 is replaced, CRLF accepted),
writes one line per input line, in order, flushed after every chunk.
"""
from __future__ import annotations

import argparse
import sys

from . import cliargs
from .cliargs import MAX_BEAM, int_range, nonneg_float, nonneg_int, positive_int
from .modeldir import ModelDirError
from .optimisations import OPTIMISATIONS
from .translator import Translator

MAX_WORKERS = 256  # processes; more is a typo, not a machine


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m decoder", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="model dir (config.json, model.safetensors, spm.model)")
    p.add_argument("--beam", type=int_range(1, MAX_BEAM), default=1,
                   help=f"beam size, 1 to {MAX_BEAM}; 1 = greedy")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "int8", "fp16"],
                   help="auto: fp16 on CUDA; on CPU int8 where it beats fp32 here (measured at start), else fp32")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    p.add_argument("--workers", type=int_range(0, MAX_WORKERS), default=0,
                   help="CPU: N processes, each pinned to a core with one thread, fed whole batches "
                        "(same output as one process with --threads 1; often faster than N threads)")
    p.add_argument("--max-tokens", type=positive_int, default=4096, help="padded source tokens per batch")
    p.add_argument("--max-sentences", type=positive_int, default=512)
    p.add_argument("--chunk-lines", type=positive_int, default=20000,
                   help="lines read, sorted and batched together before output")
    p.add_argument("--length-penalty", type=nonneg_float, default=1.0)
    p.add_argument("--max-len-a", type=nonneg_float, default=1.5)
    p.add_argument("--max-len-b", type=nonneg_int, default=10)
    p.add_argument("--no-repeat-ngram", type=nonneg_int, default=0,
                   help="no n-gram of this size twice in one output (0 = off)")
    g = p.add_argument_group("optimisations", "each on or off (decoder/optimisations.py; the defaults are the "
                             "measured best, docs/bench)")
    for o in OPTIMISATIONS:
        g.add_argument("--" + o.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=o.default,
                       help=f"{o.label}; off: {o.replaces}")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        tr = Translator(a.model, device=a.device, precision=a.precision, threads=a.threads,
                        beam=a.beam, max_tokens=a.max_tokens, max_sentences=a.max_sentences,
                        chunk_lines=a.chunk_lines, workers=a.workers, length_penalty=a.length_penalty,
                        max_len_a=a.max_len_a, max_len_b=a.max_len_b, no_repeat_ngram=a.no_repeat_ngram,
                        **{o.name: getattr(a, o.name) for o in OPTIMISATIONS})
    except (ModelDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .textio import line_cap, read_lines
    out = sys.stdout.buffer
    with tr:
        lines = read_lines(sys.stdin.buffer, max_bytes=line_cap(tr.cfg.arch.max_positions))
        for line in tr.translate_stream(lines):
            # errors="replace": a lone surrogate must not cost us the line
            out.write(line.encode("utf-8", errors="replace") + b"\n")
            out.flush()  # a pipe reader sees each line as soon as it is in order
    return 0


if __name__ == "__main__":
    sys.exit(cliargs.run(main))
