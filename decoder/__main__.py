"""Translate text with a model dir: one output line per input line, in input order.

python -m decoder --model DIR [-i IN] [-o OUT] [--beam-size N] [--precision ...] < in > out

Reads its input (stdin or -i) incrementally as bytes (invalid UTF-8 is replaced,
CRLF accepted) and writes one line per input line, in order: to stdout, flushed
after every chunk, or with -o to a file that appears whole when the run ends.
On a terminal, each line is translated as soon as it is typed.

The decoder's optimisations (decoder/optimisations.py) are switches, each on or
off with `--set NAME=on|off` and listed with their measured worth by
`--list-switches`; the settings that tune them (chunk_lines, ...) take
`--set NAME=VALUE`. Their defaults are the measured best: --help shows the
options a user chooses.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys

from . import cgroup, cliargs, fileerrors, lifecycle
from .cliargs import (BEAM_MAX_TOKENS, GPU_MAX_SENTENCES, GPU_MAX_TOKENS, MAX_BEAM, MAX_LEN, MAX_LENGTH_PENALTY,
                      MAX_SENTENCES, MAX_THREADS, MAX_TOKENS, float_range, int_range, positive_int)
from .modeldir import ModelDirError, NoShortlist, first_line, is_allocation_failure
from .optimisations import BY_NAME, OPTIMISATIONS
from .runtime import describe
from .translator import Options, Translator
from .workers import usable_workers

MAX_WORKERS = 256  # processes; more is a typo, not a machine
CHUNK_LINES = 20000
# the Options the command line sets with options of their own; the others (KNOBS) take --set
OWN = ("beam", "max_tokens", "max_sentences", "workers", "length_penalty", "max_len_a", "max_len_b",
       "no_repeat_ngram")


def on_off(text: str) -> bool:
    if text.lower() not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text.lower() == "on"


def knob_type(name: str):
    """The parser of the setting `name` (an Options field), within its bounds (Options.RANGES), or
    None where the command line cannot say its value."""
    bounds = {n: (kind, lo, hi) for n, kind, lo, hi in Options.RANGES}
    if name in bounds:
        kind, lo, hi = bounds[name]
        # the type's own cap (MAX_INT) is no bound to name: "must be >= 1"
        return (int_range if kind is int else float_range)(lo, None if hi == cliargs.MAX_INT else hi)
    default = next(f.default for f in dataclasses.fields(Options) if f.name == name)
    return on_off if isinstance(default, bool) else None


# the settings that are not switches but tune them (the benchmarks' and the tests' knobs): --set NAME=VALUE
KNOBS = {f.name: t for f in dataclasses.fields(Options)
         if f.name not in (*OWN, "switches") and (t := knob_type(f.name)) is not None}
SETTABLE = {**{o.name: on_off for o in OPTIMISATIONS}, **KNOBS}


def setting(text: str) -> tuple:
    """`--set NAME=VALUE` -> (NAME, value): a switch on or off, or a setting's value; a name
    that is neither is refused with the close ones."""
    name, eq, value = (x.strip() for x in text.partition("="))
    name = name.replace("-", "_")
    if not eq:
        raise argparse.ArgumentTypeError(f"expected NAME=on|off or NAME=VALUE, got {text!r}")
    if name not in SETTABLE:
        close = difflib.get_close_matches(name, SETTABLE, n=3)
        raise argparse.ArgumentTypeError(f"unknown switch or setting {name!r}; "
                                         + (f"did you mean {', '.join(close)}?" if close
                                            else "python -m decoder --list-switches lists them"))
    try:
        return name, SETTABLE[name](value)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{name}={value}: {e}") from None


class SetAction(argparse.Action):
    """--set NAME=VALUE: the namespace's NAME, as its own option would set it."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, *value)


def switch_table() -> str:
    """--list-switches: each switch's name, default, what it does and its measured worth; then the settings."""
    width = max(map(len, SETTABLE))
    rows = [f"{'switch':{width}}  default  what it does; measured worth (device, date, ratio)"]
    rows += [f"{o.name:{width}}  {'on' if o.default else 'off':7}  {o.label}; worth: {o.worth or 'not stated'}"
             for o in OPTIMISATIONS]
    rows += ["", f"{'setting':{width}}  default (--set NAME=VALUE)"]
    rows += [f"{name:{width}}  {_said(getattr(Options, name))}" for name in KNOBS]
    return "\n".join(rows)


def _said(default) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return "the device's" if default is None else str(default)


class ListSwitches(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(switch_table())  # stdout, as --help: a listing to read or grep, not an error
        parser.exit(0)


def shortlist_help() -> str:
    if BY_NAME["shortlist"].default:
        return "the model dir's lexical shortlist (default: the model dir's shortlist when it has one)"
    return "the model dir's lexical shortlist (default: off)"


def parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="python -m decoder", usage="%(prog)s --model DIR [options] < in > out",
                               description=__doc__.split("\n\n")[0], add_help=False,
                               formatter_class=cliargs.HelpFormatter)
    # a switch or setting not given is the library's default (the options below that set one say theirs)
    p.set_defaults(**dict.fromkeys(SETTABLE))
    add_user_options(p)
    # the old option of a setting that --set now takes: users' scripts have it
    p.add_argument("--chunk-lines", type=positive_int, default=CHUNK_LINES, help=argparse.SUPPRESS)
    g = p.add_argument_group("switches and settings", "the decoder's optimisations (decoder/optimisations.py), "
                             "each at its measured best by default, and the settings that tune them")
    g.add_argument("--set", action=SetAction, type=setting, metavar="NAME=on|off",
                   help="a switch on or off, or a setting NAME=VALUE (" + ", ".join(KNOBS) + "); repeatable")
    g.add_argument("--list-switches", action=ListSwitches,
                   help="print each switch's default and measured worth, and the settings, and exit")
    return p


def add_user_options(p) -> None:
    """The options a user chooses, in the order --help lists them: what to translate, where, how."""
    p.add_argument("--model", required=True, metavar="DIR", help="model dir (config.json, model.safetensors, "
                                                                 "spm.model)")
    p.add_argument("-i", "--input", default="-", metavar="FILE", help="source text, plain or gzipped; - = stdin")
    p.add_argument("-o", "--output", default="-", metavar="FILE",
                   help="translations; - = stdout. A file appears whole when the run ends, never half-written")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default=None, choices=["auto", "fp32", "bf16", "int8", "fp16"],
                   help="default (or auto): int8 on a CPU with an int8 kernel, else fp32; fp16 on CUDA")
    cliargs.alias(p, "--beam", p.add_argument(
        "--beam-size", dest="beam", metavar="N", type=int_range(1, MAX_BEAM), default=1,
        help=f"beam size, 1 to {MAX_BEAM}; 1 = greedy"))
    cliargs.alias(p, "--max-tokens", p.add_argument(
        "--max-batch-tokens", dest="max_tokens", metavar="N", type=positive_int, default=None,
        help=f"padded source tokens per batch (default: CPU {MAX_TOKENS} greedy, {BEAM_MAX_TOKENS} with a beam; "
             f"CUDA {GPU_MAX_TOKENS} / beam size)"))
    cliargs.alias(p, "--max-sentences", p.add_argument(
        "--batch-size", dest="max_sentences", metavar="N", type=positive_int, default=None,
        help=f"sentences per batch, at most (default: CPU {MAX_SENTENCES}; CUDA {GPU_MAX_SENTENCES} / beam size)"))
    p.add_argument("--threads", metavar="N", type=int_range(1, MAX_THREADS), default=None,
                   help="torch intra-op threads")
    p.add_argument("--workers", metavar="N", type=int_range(0, MAX_WORKERS), default=0,
                   help="CPU: N processes of one thread, each pinned to a core (the output of --threads 1)")
    p.add_argument("--max-len-a", metavar="A", type=float_range(0.0, MAX_LEN), default=1.5,
                   help="output at most A * source tokens + B tokens")
    p.add_argument("--max-len-b", metavar="B", type=int_range(0, MAX_LEN), default=10)
    p.add_argument("--length-penalty", metavar="P", type=float_range(0.0, MAX_LENGTH_PENALTY), default=1.0,
                   help="beam: a hypothesis' score is divided by its length ** P")
    p.add_argument("--no-repeat-ngram", metavar="N", type=int_range(0, MAX_LEN), default=0,
                   help="no n-gram of N tokens twice in one output (0 = off)")
    p.add_argument("--shortlist", action=argparse.BooleanOptionalAction, default=None, help=shortlist_help())
    p.add_argument("-q", "--quiet", action="store_true", help="no stderr line saying what runs")
    cliargs.add_version(p)
    p.add_argument("-h", "--help", action="help", help="show this help and exit")


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
    workers, lowered = usable_workers(a.workers, cgroup.model_bytes(a.model))  # more buy nothing: one warning
    if lowered:
        print(lowered, file=sys.stderr, flush=True)
    options = {name: getattr(a, name) for name in OWN}
    options["workers"] = workers
    # the switches and settings the command line set; the others are the library's defaults
    options.update({name: v for name in SETTABLE if (v := getattr(a, name)) is not None})
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
