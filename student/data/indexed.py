"""The encoded training corpus on disk: token arrays in shards, memory-mapped, with an index.

As fairseq's binarised and Megatron's indexed datasets: each shard of SHARD
pairs is three .npy files, the source and target tokens end to end (uint16 for
vocabularies up to 65,536) and an (n + 1, 2) int64 array of offsets into them.
Readers map the files, so a process holds the lengths (8 bytes a pair) and the
pages of the batches it reads: memory that does not grow with the corpus text.

    enc = encode(src_path, tgt_path, spm_model, ("en", "de"), normaliser, out_dir)
    enc["src"][i]            # int64 token ids of pair i's source, eos last
    enc.lengths()            # (src lengths, tgt lengths) as int32 arrays

A shard is written under temp names and its offsets file renamed last, so a
shard with offsets is whole: a killed encoding resumes at the missing shards.
Under torchrun rank r encodes shards i % world == r, then rank 0 writes
meta.json, which marks the corpus complete.
"""
from __future__ import annotations

import itertools
import json
import os

import numpy as np
from tqdm import tqdm

from decoder import durable, textio

from .clean import normalise
from .parallel import imap_ordered, workers

FORMAT = 1
SHARD = 50_000   # pairs a shard (and a worker's task)
LIMIT = 1022     # tokens kept a side, leaving room for eos under the presets' max_positions
SUB = 5_000      # lines normalised and encoded at a time inside a shard
POOL_BYTES = 16 << 20  # smaller sources encode in-process: starting workers would cost more


class Side:
    """One side of the corpus: side[i] is pair i's token ids (int64 array)."""

    def __init__(self, tokens: list[np.ndarray], offsets: list[np.ndarray], shard: int):
        self.tokens, self.offsets, self.shard = tokens, offsets, shard

    def __getitem__(self, i: int) -> np.ndarray:
        s, j = divmod(int(i), self.shard)
        off = self.offsets[s]
        return self.tokens[s][off[j]:off[j + 1]].astype(np.int64)

    def __len__(self):
        return sum(len(o) - 1 for o in self.offsets)


class Indexed:
    """An encoded corpus dir, memory-mapped: enc["src"], enc["tgt"], enc.lengths()."""

    def __init__(self, path: str):
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as fh:
            self.meta = json.load(fh)
        self.path, n = path, len(self.meta["shards"])
        idx = [np.load(_name(path, "idx", i), mmap_mode="r") for i in range(n)]
        self.sides = {}
        for k, side in enumerate(("src", "tgt")):
            toks = [np.load(_name(path, side, i), mmap_mode="r") for i in range(n)]
            self.sides[side] = Side(toks, [x[:, k] for x in idx], self.meta["shard_size"])

    def __getitem__(self, side: str) -> Side:
        return self.sides[side]

    def __len__(self):
        return self.meta["pairs"]

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) lengths in tokens, eos included: (N,) int32 each.

        Read from the offset files a shard at a time, not through their maps: touching every
        page of the maps would keep the whole index (16 bytes a pair) resident."""
        n = len(self.meta["shards"])
        per = [np.diff(np.load(_name(self.path, "idx", i)), axis=0).astype(np.int32) for i in range(n)]  # (n_i, 2)
        both = np.concatenate(per) if per else np.zeros((0, 2), np.int32)  # (N, 2)
        return np.ascontiguousarray(both[:, 0]), np.ascontiguousarray(both[:, 1])


def encode(src: str, tgt: str, spm_model: str, langs: tuple[str, str], normaliser: dict, out: str,
           rank: int = 0, world: int = 1, verbose: bool = True, barrier=lambda: None) -> Indexed:
    """Normalise and encode two line-aligned files into `out` (reused when complete). Every
    rank calls it (its shards, over its share of the cores); barrier() syncs the ranks."""
    if not os.path.isfile(os.path.join(out, "meta.json")):
        os.makedirs(out, exist_ok=True)
        n_shards = _encode_shards(src, tgt, spm_model, langs, normaliser, out, rank, world, verbose)
        barrier()
        if rank == 0:
            _write_meta(out, spm_model, n_shards)
    barrier()
    return Indexed(out)


def _encode_shards(src, tgt, spm_model, langs, normaliser, out, rank, world, verbose) -> int:
    """This rank's missing shards; returns the corpus' shard count."""
    import sentencepiece as spm
    dtype = "uint16" if spm.SentencePieceProcessor(model_file=spm_model).get_piece_size() <= 1 << 16 else "int32"
    setup = (spm_model, langs, normaliser, dtype, out)

    seen = [0]

    def tasks(lines, bar):
        for i, chunk in enumerate(_chunks(lines, SHARD)):
            seen[0] = i + 1
            bar.update(len(chunk))
            if i % world == rank and not os.path.exists(_name(out, "idx", i)):
                yield i, chunk  # a list of (source, target) lines

    desc = "encoding" + (f" rank {rank}/{world}" if world > 1 else "")
    with textio.open_binary(src) as fs, textio.open_binary(tgt) as ft, \
            tqdm(desc=desc, unit="pair", unit_scale=True, disable=not verbose) as bar:
        lines = _aligned(textio.read_lines(fs), textio.read_lines(ft), src, tgt)
        n_workers = workers() if os.path.getsize(src) > POOL_BYTES else 1
        for _ in imap_ordered(_encode_shard, tasks(lines, bar), n_workers, _setup, setup):
            pass
    return seen[0]


def _aligned(s, t, src, tgt):
    for a, b in itertools.zip_longest(s, t):
        if a is None or b is None:
            raise ValueError(f"{src} and {tgt} have different line counts")
        yield a, b


_WORKER: dict = {}


def _setup(spm_model, langs, normaliser, dtype, out):
    import sentencepiece as spm
    _WORKER.update(sp=spm.SentencePieceProcessor(model_file=spm_model), langs=langs, norm=normaliser,
                   dtype=dtype, out=out)


def _encode_shard(task) -> int:
    """Shard i's files from its (source, target) lines; returns i."""
    i, pairs = task
    w = _WORKER
    eos = w["sp"].eos_id()
    arrays = {}
    for k, side in enumerate(("src", "tgt")):
        toks, lens = [], []
        for j in range(0, len(pairs), SUB):
            ids = w["sp"].encode([normalise(p[k], w["langs"][k], w["norm"]) for p in pairs[j:j + SUB]])
            ids = [x[:LIMIT] + [eos] for x in ids]
            lens.extend(map(len, ids))
            toks.append(np.fromiter(itertools.chain.from_iterable(ids), w["dtype"]))
        arrays[side] = np.concatenate(toks)
        arrays[f"{side}_off"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    for side in ("src", "tgt"):
        _save(_name(w["out"], side, i), arrays[side])
    _save(_name(w["out"], "idx", i), np.stack([arrays["src_off"], arrays["tgt_off"]], axis=1))  # last
    return i


def _save(path: str, array: np.ndarray) -> None:
    durable.atomic_write(path, lambda tmp: _np_save(tmp, array))


def _np_save(tmp: str, array: np.ndarray) -> None:
    with open(tmp, "wb") as fh:  # a file object: np.save would add .npy to the temp name
        np.save(fh, array)


def _write_meta(out: str, spm_model: str, n_shards: int) -> None:
    missing = [i for i in range(n_shards) if not os.path.exists(_name(out, "idx", i))]
    if missing:
        raise RuntimeError(f"{out}: shards {missing[:5]} missing after encoding")
    shards = [len(np.load(_name(out, "idx", i), mmap_mode="r")) - 1 for i in range(n_shards)]
    durable.write_json(os.path.join(out, "meta.json"),
                       {"format": FORMAT, "pairs": sum(shards), "shard_size": SHARD, "shards": shards,
                        "spm_model": os.path.abspath(spm_model)})


def _name(out: str, kind: str, i: int) -> str:
    return os.path.join(out, f"{kind}-{i:05d}.npy")


def _chunks(it, size: int):
    it = iter(it)
    while chunk := list(itertools.islice(it, size)):
        yield chunk
