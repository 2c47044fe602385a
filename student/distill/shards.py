"""Sharded, resumable translation of the training source side.

Shard i holds source lines [i*size, (i+1)*size). A shard's translation is
written to a temp file and renamed into place, so a file named shard-XXXXX.txt
is always complete; a killed run restarts at the first missing shard. Under
torchrun rank r takes the shards with i % world == r. The source is read from
its file one shard at a time, and the shards are assembled as a stream: memory
holds a shard, whatever the corpus' size.
"""
from __future__ import annotations

import itertools
import os
import re
import time

from tqdm import tqdm

from decoder import durable, textio


_TMP = re.compile(r"shard-(\d+)\.txt\.tmp\.\d+")  # durable.tmp_name of a shard


def shard_path(shard_dir: str, i: int) -> str:
    return os.path.join(shard_dir, f"shard-{i:05d}.txt")


def n_shards(n_lines: int, size: int) -> int:
    return (n_lines + size - 1) // size


def write_atomic(path: str, lines: list[str]) -> None:
    durable.write_lines(path, lines)


def read_shard(path: str) -> list[str]:
    with open(path, "rb") as fh:
        return list(textio.read_lines(fh))


def shard_complete(path: str) -> bool:
    """A shard ends with the newline of its last line; without it the file is cut short
    (its last line may be cut too: 'LINE 24' read as 'LINE ')."""
    try:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"
    except OSError:  # missing, or empty (seek before the start)
        return False


def missing_shards(shard_dir: str, n_lines: int, size: int, rank: int = 0, world: int = 1) -> list[int]:
    """This rank's shards still to translate: absent or incomplete."""
    mine = range(rank, n_shards(n_lines, size), world)
    return [i for i in mine if not shard_complete(shard_path(shard_dir, i))]


def count_lines(path: str) -> int:
    """Lines as decoder.textio reads them: every "\\n", plus a last line without one."""
    n, last = 0, b"\n"
    with textio.open_binary(path) as fh:
        while block := fh.read(1 << 20):
            n, last = n + block.count(b"\n"), block[-1:]
    return n + (last != b"\n")


def _source_shards(src, size: int, todo: list[int]):
    """(i, lines) for each shard in todo; src is the lines (a list) or a file, streamed so that
    one shard at a time is in memory."""
    if isinstance(src, (list, tuple)):
        yield from ((i, src[i * size:(i + 1) * size]) for i in todo)
        return
    want = set(todo)
    with textio.open_binary(src) as fh:
        lines = (x.strip() for x in textio.read_lines(fh))  # as student.data.read_lines
        for i in itertools.count():
            chunk = list(itertools.islice(lines, size))
            if not chunk:
                return
            if i in want:
                yield i, chunk


def translate_shards(teacher, src, shard_dir: str, size: int, rank: int = 0, world: int = 1,
                     verbose: bool = True) -> dict:
    """Translate this rank's missing shards of `src` (the source lines, or a file of them, read a
    shard at a time); returns what was translated now and how long it took."""
    os.makedirs(shard_dir, exist_ok=True)
    for f in os.listdir(shard_dir):  # leftovers of a killed writer; only whole shards count
        m = _TMP.fullmatch(f)  # anything else in the dir is not ours to remove, nor to choke on
        if m and int(m.group(1)) % world == rank:
            os.remove(os.path.join(shard_dir, f))
    n = len(src) if isinstance(src, (list, tuple)) else count_lines(src)
    todo = missing_shards(shard_dir, n, size, rank, world)

    def length(i):
        return min(size, n - i * size)
    total = sum(length(i) for i in range(rank, n_shards(n, size), world))
    remaining = sum(length(i) for i in todo)
    desc = "distill" + (f" rank {rank}/{world}" if world > 1 else "")
    bar = tqdm(total=total, initial=total - remaining, unit="sent", desc=desc, dynamic_ncols=True,
               disable=not verbose, smoothing=0.1)
    t0, words = time.time(), 0
    try:
        for i, lines in _source_shards(src, size, todo):
            out = teacher.translate(lines, where=f"shard {i} (lines {i * size + 1}-{i * size + len(lines)})")
            if len(out) != len(lines):  # the teachers check too; this guards the file format itself
                raise RuntimeError(f"shard {i}: {len(out)} translations for {len(lines)} lines")
            write_atomic(shard_path(shard_dir, i), out)
            words += sum(len(x.split()) for x in lines)
            bar.update(len(lines))
    finally:
        bar.close()  # ends the bar's line, so an error message starts on its own
    secs = time.time() - t0
    return {"translated_shards": len(todo), "sentences": remaining, "words": words, "seconds": round(secs, 2),
            "words_per_second": round(words / secs, 1) if todo and secs > 0 else None}


def assemble(shard_dir: str, n_lines: int, size: int) -> list[str]:
    """All shards in order; every shard must exist, be complete and have its exact line count."""
    return list(iter_assembled(shard_dir, n_lines, size))


def iter_assembled(shard_dir: str, n_lines: int, size: int):
    """assemble's lines as a stream, one shard in memory at a time."""
    for i in range(n_shards(n_lines, size)):
        p = shard_path(shard_dir, i)
        if not os.path.exists(p):
            raise RuntimeError(f"{p}: shard missing")
        if not shard_complete(p):
            raise RuntimeError(f"{p}: shard incomplete (no final newline); a rerun translates it again")
        lines = read_shard(p)
        want = min(size, n_lines - i * size)
        if len(lines) != want:
            raise RuntimeError(f"{p}: {len(lines)} lines, expected {want}")
        yield from lines
