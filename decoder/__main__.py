"""python -m decoder --model DIR [-i IN] [-o OUT] [--beam-size N] [--precision ...] < in > out

Reads its input (stdin or -i) incrementally as bytes (invalid UTF-8 is replaced,
CRLF accepted) and writes one line per input line, in order: to stdout, flushed
after every chunk, or with -o to a file that appears whole when the run ends.
On a terminal, each line is translated as soon as it is typed.
"""
from __future__ import annotations

import argparse
import os
import sys

from . import cliargs, fileerrors, lifecycle, refill
from .cliargs import (BEAM_MAX_TOKENS, GPU_MAX_SENTENCES, GPU_MAX_TOKENS, MAX_BEAM, MAX_LEN, MAX_LENGTH_PENALTY,
                      MAX_SENTENCES, MAX_THREADS, MAX_TOKENS, float_range, int_range, positive_int)
from .modeldir import ModelDirError, NoShortlist, first_line, is_allocation_failure
from .optimisations import OPTIMISATIONS
from .runtime import describe
from .translator import DEFAULT_PRECISION, Translator

MAX_WORKERS = 256  # processes; more is a typo, not a machine
CHUNK_LINES = 20000


def parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="python -m decoder", description=__doc__.split("\n\n")[0],
                               formatter_class=cliargs.HelpFormatter)
    cliargs.add_version(p)
    p.add_argument("--model", required=True, help="model dir (config.json, model.safetensors, spm.model)")
    p.add_argument("-i", "--input", default="-", help="source text, plain or gzipped; - = stdin")
    p.add_argument("-o", "--output", default="-",
                   help="translations; - = stdout. A file is written next to its name and renamed over it "
                        "when complete: it is never seen half-written (a symlink's target is; a device or "
                        "FIFO is written in place)")
    cliargs.alias(p, "--beam", p.add_argument(
        "--beam-size", dest="beam", metavar="N", type=int_range(1, MAX_BEAM), default=1,
        help=f"beam size, 1 to {MAX_BEAM}; 1 = greedy (old name: --beam)"))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    # the library's default (translator.DEFAULT_PRECISION): the same output as Translator(model)
    p.add_argument("--precision", default=None, choices=["auto", "fp32", "bf16", "int8", "fp16"],
                   help=f"default: {DEFAULT_PRECISION['cpu']} on CPU (the model's own output, the same on every "
                        f"CPU), {DEFAULT_PRECISION['cuda']} on CUDA; auto: fp16 on CUDA, on CPU int8 where it beats "
                        "fp32 here (measured at start), else fp32")
    p.add_argument("--threads", type=int_range(1, MAX_THREADS), default=None, help="torch intra-op threads")
    p.add_argument("--workers", type=int_range(0, MAX_WORKERS), default=0,
                   help="CPU: N processes, each pinned to a core with one thread, fed whole batches "
                        "(same output as one process with --threads 1; often faster than N threads)")
    cliargs.alias(p, "--max-tokens", p.add_argument(
        "--max-batch-tokens", dest="max_tokens", metavar="N", type=positive_int, default=None,
        help=f"padded source tokens per batch (default: CPU {MAX_TOKENS} greedy, {BEAM_MAX_TOKENS} with a beam; "
             f"CUDA {GPU_MAX_TOKENS} / beam size; old name: --max-tokens); CUDA greedy decodes a chunk through "
             f"one state of N/{refill.ROW_TOKENS} rows (switch refill_rows)"))
    cliargs.alias(p, "--max-sentences", p.add_argument(
        "--batch-size", dest="max_sentences", metavar="N", type=positive_int, default=None,
        help=f"sentences per batch, at most (default: CPU {MAX_SENTENCES}; CUDA {GPU_MAX_SENTENCES} / beam size; "
             "old name: --max-sentences)"))
    p.add_argument("--chunk-lines", type=positive_int, default=CHUNK_LINES,
                   help="lines read, sorted and batched together before output; "
                        "1 when the input is a terminal (line by line)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no stderr line saying the precision, threads and ISA that run")
    p.add_argument("--length-penalty", type=float_range(0.0, MAX_LENGTH_PENALTY), default=1.0,
                   help="beam: a hypothesis' score is divided by its length ** this")
    p.add_argument("--max-len-a", type=float_range(0.0, MAX_LEN), default=1.5,
                   help="output at most a * source tokens + b tokens (and the model's positions); "
                        "a cap below one token gives empty lines, one per input line")
    p.add_argument("--max-len-b", type=int_range(0, MAX_LEN), default=10)
    p.add_argument("--no-repeat-ngram", type=int_range(0, MAX_LEN), default=0,
                   help="no n-gram of this size twice in one output (0 = off)")
    g = p.add_argument_group("optimisations", "each on or off (decoder/optimisations.py; the defaults are the "
                             "measured best, docs/bench)")
    for o in OPTIMISATIONS:
        g.add_argument("--" + o.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=o.default,
                       help=f"{o.label}; off: {o.replaces}")
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def reading_mode(a, stdin) -> dict:
    """Chunking of the input: a person typing at a terminal gets each line's
    translation before typing the next, so one line per chunk and no read-ahead
    thread; a pipe or a file is read, sorted and batched chunk_lines at a time."""
    interactive = a.input == "-" and stdin.isatty()
    return dict(chunk_lines=1, pipeline=False) if interactive else dict(chunk_lines=a.chunk_lines)


def open_input(path: str):
    from .textio import open_binary
    return sys.stdin.buffer if path == "-" else open_binary(path)


def check_output(path: str) -> None:
    """Refuse an output path that cannot be written before minutes of decoding, not after:
    OSError saying why, the words after `--output PATH: `."""
    if path == "-":
        return
    if why := cliargs.file_in_the_way(path, file=True):  # resolve() would raise NotADirectoryError
        raise OSError(why)
    from .durable import resolve
    target, in_place = resolve(path)  # where atomic_write will write
    if os.path.isdir(target):
        raise OSError("is a directory")
    if in_place:  # a device or a FIFO: opening it is the check
        return
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise OSError(f"no such directory {parent}")
    if not os.access(parent, os.W_OK):
        raise OSError(f"cannot write in {parent}")


class InputError(Exception):
    """The input could not be read to its end (a truncated .gz, an I/O error)."""


def _lines(src, max_bytes: int):
    from .textio import read_lines
    try:
        yield from read_lines(src, max_bytes=max_bytes)
    except (OSError, EOFError) as e:  # gzip raises EOFError for a file cut short
        raise InputError(str(e)) from None


def translate(tr: Translator, src, out, flush: bool) -> None:
    from .textio import line_cap
    for line in tr.translate_stream(_lines(src, line_cap(tr.cfg.arch.max_positions))):
        # errors="replace": a lone surrogate must not cost us the line
        out.write(line.encode("utf-8", errors="replace") + b"\n")
        if flush:
            out.flush()  # a pipe reader sees each line as soon as it is in order


class _Refused(Exception):
    """A refusal before any line is read: its message is the one line the user sees (exit 2)."""


def _start(a, closed):
    """The input opened and the translator loaded, or _Refused with why not."""
    error = lifecycle.closed_error(closed, stdin=a.input == "-", stdout=a.output == "-")
    if error:
        raise _Refused(error)
    try:
        check_output(a.output)
    except OSError as e:
        raise _Refused(f"error: --output {a.output}: {e}") from None
    try:
        src = open_input(a.input)
    except OSError as e:
        raise _Refused(f"error: {cliargs.path_error('--input', a.input, e)}") from None
    options = dict(beam=a.beam, max_tokens=a.max_tokens, max_sentences=a.max_sentences, workers=a.workers,
                   length_penalty=a.length_penalty, max_len_a=a.max_len_a, max_len_b=a.max_len_b,
                   no_repeat_ngram=a.no_repeat_ngram, **{o.name: getattr(a, o.name) for o in OPTIMISATIONS})
    options.update(reading_mode(a, sys.stdin))
    try:
        return src, Translator(a.model, device=a.device, precision=a.precision, threads=a.threads, **options)
    except NoShortlist as e:
        raise _Refused(f"error: --shortlist: {first_line(e)}") from None
    except ModelDirError as e:
        raise _Refused(f"error: --model {first_line(e)}") from None
    except ValueError as e:
        raise _Refused(f"error: {e}") from None
    except (MemoryError, RuntimeError) as e:
        if not is_allocation_failure(e):
            raise
        raise _Refused(f"error: --model {a.model}: not enough memory to load the model ({first_line(e)})") from None


def _translate_all(a, tr: Translator, src) -> int:
    """Every line of `src` translated to --output; the exit status, with one line on stderr when not 0."""
    try:
        if a.output == "-":
            translate(tr, src, sys.stdout.buffer, flush=True)
            return 0
        from .durable import atomic_write, remove_stale_beside
        remove_stale_beside(a.output)  # the OUT.tmp.PID of a run that was killed

        def write(tmp: str) -> None:
            with open(tmp, "wb") as out:
                translate(tr, src, out, flush=False)
        atomic_write(a.output, write)
        return 0
    except InputError as e:
        print(f"error: cannot read --input {a.input} to its end: {e}", file=sys.stderr)
    except BrokenPipeError:
        raise  # the reader went away (`| head`): cliargs.run ends quietly, as Unix tools do
    except OSError as e:  # a full disk: the previous file stays, no partial one appears
        print(f"error: cannot write {a.output}: {e.strerror or e}", file=sys.stderr)
    except RuntimeError as e:
        if not lifecycle.thread_refused(e):
            raise
        print(lifecycle.thread_refused(e), file=sys.stderr)
    return 1


@fileerrors.one_line
def main(argv=None) -> int:
    closed = lifecycle.standard_streams()  # first: before any file takes a closed stream's descriptor
    a = parse_args(argv)
    try:
        src, tr = _start(a, closed)
    except _Refused as e:
        print(e, file=sys.stderr)
        return 2
    if not a.quiet:
        print(describe(tr, a.precision), file=sys.stderr, flush=True)
    with tr, src:
        return _translate_all(a, tr, src)


def cli() -> int:
    """`python -m decoder` and the `wmt-kit-translate` console script."""
    lifecycle.stop_on_signals()  # the process's own handlers: not for main() called in-process
    return cliargs.run(main)


if __name__ == "__main__":
    sys.exit(cli())
