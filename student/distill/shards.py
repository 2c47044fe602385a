"""Sharded, resumable translation of the training source side.

Shard i holds source lines [i*size, (i+1)*size). A shard's translation is
written to a temp file and renamed into place, so a file named shard-XXXXX.txt
is always complete; a killed run restarts at the first missing shard. Under
torchrun rank r takes the shards with i % world == r.
"""
from __future__ import annotations

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


def translate_shards(teacher, src: list[str], shard_dir: str, size: int, rank: int = 0, world: int = 1,
                     verbose: bool = True) -> dict:
    """Translate this rank's missing shards; returns what was translated now and how long it took."""
    os.makedirs(shard_dir, exist_ok=True)
    for f in os.listdir(shard_dir):  # leftovers of a killed writer; only whole shards count
        m = _TMP.fullmatch(f)  # anything else in the dir is not ours to remove, nor to choke on
        if m and int(m.group(1)) % world == rank:
            os.remove(os.path.join(shard_dir, f))
    todo = missing_shards(shard_dir, len(src), size, rank, world)
    total = sum(len(src[i * size:(i + 1) * size]) for i in range(rank, n_shards(len(src), size), world))
    remaining = sum(len(src[i * size:(i + 1) * size]) for i in todo)
    desc = "distill" + (f" rank {rank}/{world}" if world > 1 else "")
    bar = tqdm(total=total, initial=total - remaining, unit="sent", desc=desc, dynamic_ncols=True,
               disable=not verbose, smoothing=0.1)
    t0 = time.time()
    try:
        for i in todo:
            lines = src[i * size:(i + 1) * size]
            out = teacher.translate(lines, where=f"shard {i} (lines {i * size + 1}-{i * size + len(lines)})")
            if len(out) != len(lines):  # the teachers check too; this guards the file format itself
                raise RuntimeError(f"shard {i}: {len(out)} translations for {len(lines)} lines")
            write_atomic(shard_path(shard_dir, i), out)
            bar.update(len(lines))
    finally:
        bar.close()  # ends the bar's line, so an error message starts on its own
    secs = time.time() - t0
    words = sum(len(x.split()) for i in todo for x in src[i * size:(i + 1) * size])
    return {"translated_shards": len(todo), "sentences": remaining, "words": words, "seconds": round(secs, 2),
            "words_per_second": round(words / secs, 1) if todo and secs > 0 else None}


def assemble(shard_dir: str, n_lines: int, size: int) -> list[str]:
    """All shards in order; every shard must exist, be complete and have its exact line count."""
    out = []
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
        out.extend(lines)
    return out
