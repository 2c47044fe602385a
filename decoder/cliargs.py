"""What every command line of the kit shares.

argparse `type=` callables that refuse out-of-range numbers at parse time:

    p.add_argument("--beam", type=int_range(1, 64), default=1)

A bad value is argparse's own one-line error (`error: argument --beam: ...`,
exit 2) before any model is loaded, instead of a traceback, an empty output or
a search that runs for minutes.

And `run(main)`, the `__main__` wrapper that ends quietly when the reader of
stdout goes away (`... | head -1`), as Unix tools do; `add_version(p)`, the
`--version` every command has.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import signal
import sys
from typing import NoReturn

from .modeldir import MAX_POSITIONS, ModelDirError, check_files, first_line, read_config

# the widest beam a command accepts: wider only costs time (100000 ran for
# minutes before anything was refused)
MAX_BEAM = 64
# padded source tokens per batch, the decoder's and the tools' default: on CPU the
# int8 student's activations stay in cache at this size (decoder/README.md "Settings")
MAX_TOKENS = 1536
# with a beam: a batch decodes beam rows per sentence and normalises over its
# shortlist union, and half the source tokens measured 1.08-1.12x faster at beam
# 4 on the KD student (decoder/README.md "Settings")
BEAM_MAX_TOKENS = 768


# Upper bounds of every option without a tighter one of its own: values past them
# reach no use (a count, a budget, a seed) and break the types they end up in
# (SentencePiece's and numpy's 32-bit ints, a subprocess timeout in int64
# nanoseconds: `--timeout 1e300` was an OverflowError after minutes of work).
MAX_INT = 2**31 - 1
MAX_FLOAT = 1e6
# torch's intra-op threads: more than any machine has; 2**31-1 was accepted and
# would have started that many threads at the first product
MAX_THREADS = 1024
# The decoder's search options. Positions are capped by the model dir schema
# (decoder/modeldir.py MAX_POSITIONS), so an output length cap or an n-gram size
# past them changes nothing, and they keep a * source tokens + b exact in
# float32 and int64. The length penalty divides a score by (t + 1) ** penalty:
# 400 overflowed float64 (OverflowError); at 10, 65,536 ** 10 is 1.5e48.
MAX_LEN = MAX_POSITIONS
MAX_LENGTH_PENALTY = 10.0

MAX_SENTENCES = 512
# On CUDA a batch is sized for the GPU: on one H200 with the student-6-1 in fp16
# (docs/bench/gpu.md), greedy went 92k words/s at 8k tokens, 288k at 32k and 362k
# at 64k; beam 4 went 56k at 8k tokens, 73k at 16k and 79k at 32k. A beam step has
# beam rows per sentence, so both the tokens and the sentences are divided by the
# beam, the rows a step decodes stay about greedy's. (On the H100 before the
# host-side work, greedy stopped growing at 32k: 1.3-2.7 GB of GPU memory at 32k-128k.)
GPU_MAX_TOKENS = 65536
GPU_MAX_SENTENCES = 8192


def max_tokens_for(beam: int, device: str = "cpu") -> int:
    """The default padded source tokens per batch of a search with `beam` on `device`."""
    if device.startswith("cuda"):
        return max(GPU_MAX_TOKENS // beam, 256)
    return MAX_TOKENS if beam == 1 else BEAM_MAX_TOKENS


def max_sentences_for(beam: int, device: str = "cpu") -> int:
    """The default sentences per batch, at most, of a search with `beam` on `device`."""
    return max(GPU_MAX_SENTENCES // beam, 16) if device.startswith("cuda") else MAX_SENTENCES


def _number(kind, text: str):
    try:
        x = kind(text)
    except ValueError:  # also int() of more than sys.get_int_max_str_digits() digits
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {_short(repr(text))}") from None
    if kind is float and not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {_short(repr(text))}")
    return x


def _ranged(kind, lo, hi, above: bool = False):
    """A `kind` number in [lo, hi] (above: > lo). hi None is the type's own cap
    (MAX_INT, MAX_FLOAT), which the message names only when it is the bound broken."""
    cap = hi if hi is not None else (MAX_INT if kind is int else MAX_FLOAT)

    def parse(text: str):
        x = _number(kind, text)
        if lo is not None and (x <= lo if above else x < lo) or x > cap:
            if above:
                want = f"> {lo}" + (f" and <= {cap:g}" if x > cap else "")
            elif hi is None:
                want = f">= {lo}" if x <= cap else f"<= {cap:,}" if kind is int else f"<= {cap:g}"
            elif lo is None:
                want = f"<= {hi}"
            else:
                want = f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {want}, got {_short(text)}")
        return x
    # argparse names the type in "invalid <name> value" when a ValueError escapes
    parse.__name__ = f"{kind.__name__}_range"
    return parse


def _short(text: str, width: int = 40) -> str:
    """An argument for an error line: a 5,000-digit number is cut."""
    return text if len(text) <= width else f"{text[:width]}... ({len(text):,} characters)"


def int_range(lo: int | None = None, hi: int | None = None):
    """An int in [lo, hi] (hi None: MAX_INT)."""
    return _ranged(int, lo, hi)


def float_range(lo: float | None = None, hi: float | None = None):
    """A finite float in [lo, hi] (hi None: MAX_FLOAT)."""
    return _ranged(float, lo, hi)


def int_list(lo: int | None = None, hi: int | None = None):
    """A comma list of ints, each in [lo, hi]: "1,2,4" -> [1, 2, 4]."""
    one = int_range(lo, hi)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
        return [one(x) for x in items]
    parse.__name__ = "int_list"
    return parse


positive_int = int_range(1)
nonneg_int = int_range(0)
positive_float = _ranged(float, 0.0, None, above=True)
nonneg_float = float_range(0.0)


class Refused(SystemExit):
    """An option refused after parsing, by an entry point's check of what the run can do:
    its one `error:` line is printed, the status is 2. A SystemExit, as argparse's own
    refusals, for a caller of the check; a main() returns 2 for it."""


def refuse(message) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise Refused(2)


def model_dir_error(flag: str, path: str, shortlist: bool = True) -> str | None:
    """Why `flag path` is no model dir whose config reads and whose files are there (a
    listed shortlist too, unless the command never reads it), as one line naming the option
    ("--model m: model dir does not exist"), or None. Every command says it so."""
    try:
        check_files(path, read_config(path), shortlist)
    except ModelDirError as e:
        return f"{flag} {first_line(e)}"
    return None


def file_error(flag: str | None, path: str) -> str | None:
    """Why `flag path` is no input file, as one line naming the option (None: a positional
    argument, the path alone), or None."""
    if os.path.isfile(path):
        return None
    return f"{_named(flag, path)}: {'is a directory' if os.path.isdir(path) else 'no such file'}"


def path_error(flag: str | None, path: str, e: OSError) -> str:
    """An input or output path the OS refused, as one line naming the option (None: a
    positional argument), in the words of a missing input file ("--src in.en: no such file")."""
    why = {FileNotFoundError: "no such file", IsADirectoryError: "is a directory"}.get(type(e))
    return f"{_named(flag, path)}: {why or (e.strerror or str(e)).lower()}"


def out_dir_error(flag: str | None, path: str, file: bool = False) -> str | None:
    """Why `flag path` cannot be an output folder (it, or the nearest folder above it that
    exists, is a file), as one line naming the option, or None; `file`: path names a file (or
    a prefix of files) to write, so only the folders above it count. Checked before any work:
    the folder is often made only when the first result is written, hours in."""
    why = file_in_the_way(path, file)
    return f"{_named(flag, path)}: {why}" if why else None


def file_in_the_way(path: str, file: bool = False) -> str | None:
    """out_dir_error's reason alone ("/a is a file, not a directory"), or None."""
    p = os.path.abspath(path)
    if os.path.exists(p) and not file:
        return None if os.path.isdir(p) else "exists and is not a directory"
    above = os.path.dirname(p)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    return None if os.path.isdir(above) else f"{above} is a file, not a directory"


def _named(flag: str | None, path: str) -> str:
    return f"{flag} {path}" if flag else path


def refuse_missing(model: str | None = None, **files: str | None) -> None:
    """A tool's --model whose config does not read, or an input file (by its option's name) that
    is not there: one error line and status 2 before anything loads, not a traceback from it."""
    if model is not None and (why := model_dir_error("--model", model)):
        refuse(why)
    for flag, path in files.items():
        if path is not None and (why := file_error(f"--{flag}", path)):
            refuse(why)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line: the error and where the options
    are, without argparse's usage block first (the decoder's is 60 lines, for one typo).
    Every command's parser and subparsers are this one (tests/test_cli_conventions.py), and
    its --help says each default the kit's way (HelpFormatter) unless told otherwise."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default, said once: also for options without a help
    text, not where the text already says it, nor for options whose default is
    nothing (None, False, "", []) or a --no-x switch's True."""

    @staticmethod
    def _shows_default(action) -> bool:
        d = action.default
        return not (d is None or d is False or d is argparse.SUPPRESS or d == "" or d == []
                    or isinstance(action, argparse._StoreFalseAction)
                    or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)))

    def _format_action(self, action):
        if not action.help and action.help is not argparse.SUPPRESS and self._shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not self._shows_default(action):
            return text
        return text + " (default: %(default)s)"


def alias(parser, old: str, action: argparse.Action) -> None:
    """`old` keeps working as another name of `action` (users' scripts have it)
    without a line of --help; errors name the option as the user typed it."""
    kw = dict(dest=action.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if isinstance(action, argparse._StoreTrueAction):
        kw["action"] = "store_true"
    else:
        kw.update(type=action.type, metavar=action.metavar, choices=action.choices, nargs=action.nargs)
    parser.add_argument(old, **kw)


DIST = "wmt-efficiency-kit"


def version() -> str:
    """`wmt-efficiency-kit 0.1.0`: the installed distribution's version, else
    pyproject.toml's (a checkout run without `pip install`)."""
    from importlib import metadata
    try:
        return f"{DIST} {metadata.version(DIST)}"
    except metadata.PackageNotFoundError:
        pass
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return f"{DIST} unknown"
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(path, "rb") as fh:
            return f"{DIST} {tomllib.load(fh)['project']['version']}"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return f"{DIST} unknown"


KIT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dir holding decoder/


def checkout_commit(root: str = KIT_ROOT) -> str | None:
    """The commit of the git checkout whose top level is root ("+dirty" when tracked
    files changed), else None: a kit unpacked inside another repository is not that
    repository's checkout, so its commit would name the wrong code."""
    import subprocess

    def git(*args):
        r = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
        return r.stdout.strip() if r.returncode == 0 else None
    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(top) != os.path.realpath(root):
            return None
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head + ("+dirty" if dirty else "") if head and len(head) == 40 else None


def add_version(parser) -> None:
    parser.add_argument("--version", action="version", version=version())


def run(main) -> int:
    """main()'s exit status; a closed stdout pipe ends the command without a traceback.

    The status is what a shell reports for a process killed by SIGPIPE (141)."""
    try:
        return main()
    except BrokenPipeError:
        # stdout is dead: point it at /dev/null so the interpreter's final flush
        # does not raise a second time on the way out
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
