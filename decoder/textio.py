"""Lines of text in: the one reader every part of the kit uses.

Splits on b"\\n" only. str.splitlines() also splits on U+2028/2029, \\x85, \\x0b,
\\x0c and \\x1c-\\x1e, so one such character inside a line of a parallel corpus
would shift every later pair. A trailing "\\r" is dropped (CRLF files), a missing
final newline still ends a line, and invalid UTF-8 is replaced, never dropped:
n lines in are n lines out.

With `max_bytes`, a longer line yields its first max_bytes bytes and the rest is
read in bounded pieces and dropped, so one line costs bounded memory whatever
the input (`line_cap` gives the bound for a model).
"""
from __future__ import annotations

import gzip
import sys
from typing import BinaryIO, Callable, Iterator

# A SentencePiece piece is at most 16 characters (64 bytes of UTF-8); 256 bytes
# per position also leaves room for the whitespace runs that normalisation
# removes. A line cut there still has more tokens than the model can use.
BYTES_PER_POSITION = 256
_PIECE = 1 << 16  # the rest of an overlong line is skipped this many bytes at a time


def line_cap(max_positions: int) -> int:
    """Bytes of one line worth reading for a model with max_positions source positions
    (256 KiB for the usual 1024)."""
    return BYTES_PER_POSITION * max_positions


def split_lines(stream: BinaryIO, max_bytes: int | None = None,
                on_cut: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """Raw lines of a binary stream, without their line ending; on_cut(line number, from 1)
    is called for each line longer than max_bytes."""
    if max_bytes is None:
        for raw in stream:
            yield raw.rstrip(b"\n").rstrip(b"\r")
        return
    n = 0
    while True:
        raw = stream.readline(max_bytes + 1)  # +1: a line of exactly max_bytes is not cut
        if not raw:
            return
        n += 1
        if raw.endswith(b"\n"):
            yield raw[:-1].rstrip(b"\r")
            continue
        if len(raw) > max_bytes:
            rest = raw
            while rest and not rest.endswith(b"\n"):
                rest = stream.readline(_PIECE)
            if on_cut is not None:
                on_cut(n)
            raw = _whole_chars(raw[:max_bytes])
        yield raw.rstrip(b"\r")


def _whole_chars(b: bytes) -> bytes:
    """b without a UTF-8 character that the cut split in two (it would decode as U+FFFD)."""
    for k in range(1, min(4, len(b)) + 1):
        c = b[-k]
        if c < 0x80:
            return b
        if c >= 0xC0:  # the lead byte: does its sequence fit in the k bytes left?
            need = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return b if need <= k else b[:-k]
    return b


def decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def read_lines(stream: BinaryIO, max_bytes: int | None = None) -> Iterator[str]:
    """Decoded lines of a binary stream (stdin: sys.stdin.buffer), read as they come.
    The first line cut at max_bytes gets one warning on stderr, with its number."""
    warned = []

    def warn(n: int) -> None:
        if not warned:
            print(f"warning: input line {n} is longer than {max_bytes} bytes; reading only its first "
                  f"{max_bytes} (more than the model can use)", file=sys.stderr, flush=True)
            warned.append(n)
    for raw in split_lines(stream, max_bytes, warn):
        yield decode(raw)


def open_binary(path: str) -> BinaryIO:
    """A plain or gzipped file, sniffed by its first bytes (a .gz without the suffix works too)."""
    with open(path, "rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def read_file(path: str, max_bytes: int | None = None) -> list[str]:
    """All lines of a plain or gzipped file."""
    with open_binary(path) as fh:
        return list(read_lines(fh, max_bytes))


def count_lines(path: str) -> int:
    """The number of lines read_file(path) gives, counted 1 MiB at a time in bounded memory
    (an option check before any work: line counts of parallel files)."""
    n, last = 0, b"\n"
    with open_binary(path) as fh:
        while chunk := fh.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")  # a final line without its newline
