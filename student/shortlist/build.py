"""Build a lexical shortlist from a parallel corpus.

For each source token, the k target tokens with the highest Dice coefficient
over sentence co-occurrence,

    dice(s, t) = 2 c(s, t) / (c(s) + c(t)),

where c(s, t) counts the sentence pairs with s in the source and t in the
target, and c(s), c(t) the sentences holding each; plus the N most frequent
target tokens, allowed in every batch. Why Dice: Marian's lex.s2t ranks by
p(t|s) from word alignments; without an aligner, p(t|s) ~ c(s, t) / c(s)
ranks the frequent target tokens ("de", ".", "la") first for every source
token, and those are in the frequent list anyway. Dice divides by c(t) as
well, so a source token's list is its translations; PMI would go the other
way and favour target tokens seen once. Dice needs no extra dependency and,
unlike an aligner (fast_align, eflomal), no extra pass over the corpus.

With `identity` each source token also lists itself (first): the vocabulary
is joint, and names, numbers and byte pieces are copied through even when the
training data never showed them.

Counting is exact and streamed (cooc.py): the corpus is read a chunk of CHUNK
pairs at a time, encoded over the cores, and its distinct ids per sentence go
to a temp dir beside the model dir; the (V, V) counts are then built a dense
(rows, V) int32 block of source rows at a time. Memory stays near 3 x `block_mb`
plus a few chunks in flight, whatever the corpus' or the vocabulary's size (32k x 32k would be
4 GB at once); disk holds about 6 bytes a distinct token. Time grows with the
number of (source, target) token pairs per sentence; for corpora of millions of
lines, `max_lines` of them give the same lists for all but rare tokens.
"""
from __future__ import annotations

import itertools
import os
import tempfile
import time
import zlib
from typing import NamedTuple

import numpy as np
import sentencepiece as spm
import torch
from tqdm import tqdm

from decoder import durable, modeldir, textio
from student.data import DataError, normalise
from student.data.corpus import Lines
from student.data.parallel import imap_ordered, workers
from student.shortlist import cooc

CHUNK = 50_000         # pairs a chunk of the first pass (a worker's task)
SUB = 5_000            # lines normalised and encoded at a time inside a chunk
POOL_BYTES = 16 << 20  # smaller corpora count in-process: starting workers would cost more
BLOCK_MB = 128


class Lexicon(NamedTuple):
    """The shortlist in the model-dir layout (decoder/modeldir.py read_shortlist)."""
    offsets: torch.Tensor   # (V+1,) int64: source token s lists ids[offsets[s]:offsets[s+1]]
    ids: torch.Tensor       # (nnz,) int64, each list best first
    frequent: torch.Tensor  # (N,) int64, most frequent first


def build(src: list[list[int]], tgt: list[list[int]], vocab_size: int, *, k: int = 100,
          n_frequent: int = 100, identity: bool = True, exclude=(), block_mb: int = BLOCK_MB) -> Lexicon:
    """The shortlist of token-id sentence pairs (module docstring); `exclude` (special
    ids) never enter a list, and their own lists stay empty.

    k = 100 and N = 100 are Marian's usual `lex.s2t 100 100`. Over k = 50 they
    cost little where it counts: on the Bible (8k vocabulary, batches of 64 test
    sentences) the batch union grows 6% (4916 -> 5215 ids) while the share of
    reference tokens inside each sentence's own candidates rises from 89% to 93%."""
    if len(src) != len(tgt):
        raise ValueError(f"{len(src)} source sentences but {len(tgt)} target sentences")
    _check(k, n_frequent)
    with tempfile.TemporaryDirectory(prefix="shortlist-") as tmp:
        p = cooc.plan(vocab_size, exclude, block_mb, tmp)
        tasks = ((i, (src[a:a + CHUNK], tgt[a:a + CHUNK]), p) for i, a in enumerate(range(0, len(src), CHUNK)))
        counted = cooc.totals(map(cooc.count_ids, tasks), vocab_size)
        return _lexicon(counted, p, k, n_frequent, identity)


def _check(k: int, n_frequent: int) -> None:
    if k < 1 or n_frequent < 0:
        raise ValueError(f"k must be >= 1 and n_frequent >= 0 (got k={k}, n_frequent={n_frequent})")


def _lexicon(counted: tuple[int, np.ndarray], p: cooc.Plan, k: int, n_frequent: int, identity: bool,
             verbose: bool = False) -> Lexicon:
    """The lists from the first pass' (chunks, totals), a row block at a time."""
    n_chunks, totals = counted
    V = p.vocab
    df_s, df_t, occ = torch.from_numpy(totals)  # (V,) each: sentences holding s, t; occurrences of t
    ex = torch.from_numpy(p.exclude)
    occ[ex] = 0
    order = torch.sort(-occ, stable=True).indices  # most frequent first, ties by id
    frequent = order[:n_frequent][occ[order[:n_frequent]] > 0]
    special = torch.zeros(V, dtype=torch.bool)
    special[ex] = True
    lengths, ids = [], []
    for b in tqdm(range(p.n_blocks), desc="shortlist: lists", unit="block", delay=1, disable=not verbose):
        lo = b * p.rows
        dice = cooc.block_counts(b, n_chunks, p).float().mul_(2)  # (R, V)
        hi = lo + dice.shape[0]
        dice.div_((df_s[lo:hi, None].float() + df_t[None, :].float()).clamp_min_(1))
        if identity:  # above any Dice (<= 1): the token itself comes first
            r = torch.arange(hi - lo)
            dice[r, r + lo] = torch.where(special[lo:hi], dice[r, r + lo], 2.0)
        dice[special[lo:hi]] = 0  # no lists for <s>, <pad>, </s>, <unk>
        val, idx = dice.topk(min(k, V), dim=1)  # (R, k) best first
        keep = val > 0  # a prefix of each row: only tokens that did co-occur
        lengths.append(keep.sum(1))
        ids.append(idx[keep])
    lengths = torch.cat(lengths)  # (V,)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    return Lexicon(offsets, torch.cat(ids).long(), frequent.long())


def _model(model_dir: str):
    """(config, SentencePiece model path) of a model dir, checked against each other."""
    cfg = modeldir.read_config(model_dir)
    spath = os.path.join(model_dir, modeldir.SPM)
    modeldir.read_spm(spath, cfg.arch.vocab_size)
    return cfg, spath


def _langs(cfg) -> tuple[str, str]:
    n = cfg.normaliser or {}
    return n.get("src_lang", cfg.src_lang), n.get("tgt_lang", cfg.tgt_lang)


def encode_corpus(model_dir: str, src_lines: list[str], tgt_lines: list[str]):
    """(config, source ids, target ids) as training saw them: the model dir's
    normaliser per side, then its SentencePiece model (no </s>)."""
    cfg, spath = _model(model_dir)
    _setup(spath, _langs(cfg), cfg.normaliser)
    return cfg, _encode(src_lines, 0), _encode(tgt_lines, 1)


_WORKER: dict = {}


def _setup(spath: str, langs: tuple[str, str], normaliser: dict | None) -> None:
    _WORKER.update(sp=spm.SentencePieceProcessor(model_file=spath), langs=langs, norm=normaliser)


def _encode(lines: list[str], side: int) -> list[list[int]]:
    w = _WORKER
    if w["norm"]:
        lines = [normalise(s, w["langs"][side], w["norm"]) for s in lines]
    return w["sp"].encode(lines)


def _encode_count(task) -> np.ndarray:
    """cooc.count_chunk of a task (i, (source, target) line pairs, plan), encoded SUB lines at a time."""
    i, pairs, p = task
    sides = []
    for side in (0, 1):
        parts = [cooc.flat(_encode([x[side] for x in pairs[j:j + SUB]], side)) for j in range(0, len(pairs), SUB)]
        sides.append(tuple(np.concatenate(a) for a in zip(*parts)))
    return cooc.count_chunk(i, sides[0], sides[1], p)


def add_to_model_dir(model_dir: str, src_path: str, tgt_path: str, *, k: int = 100, n_frequent: int = 100,
                     identity: bool = True, max_lines: int = 0, verbose: bool = False) -> dict:
    """Build the shortlist of a parallel corpus (plain or .gz files, streamed) into a model dir
    (shortlist.safetensors, listed in config.json); returns a summary. The first pass' files
    go to a temp dir beside the model dir."""
    t0 = time.time()
    _check(k, n_frequent)
    n_src, n_tgt = _line_count(src_path), _line_count(tgt_path)
    if n_src != n_tgt:
        raise DataError(f"{tgt_path}: {n_tgt} lines, but {src_path} has {n_src}")
    n = min(n_src, max_lines) if max_lines else n_src
    cfg, spath = _model(model_dir)
    parent, name = os.path.split(os.path.abspath(model_dir))
    name += "-shortlist"  # the counting dir beside the model dir, named for it in an error line
    # what a killed run left: its counting dir, its temp files in the model dir
    durable.remove_stale(parent, [name])
    durable.remove_stale(model_dir, [f"{n}{x}" for n in (modeldir.SHORTLIST, modeldir.CONFIG) for x in ("", ".old", ".undo")])
    with tempfile.TemporaryDirectory(prefix=f".{name}.tmp.{os.getpid()}.", dir=parent) as tmp:
        p = cooc.plan(cfg.arch.vocab_size, (cfg.bos_id, cfg.pad_id, cfg.eos_id, cfg.unk_id), BLOCK_MB, tmp)
        counted = _count_files(src_path, tgt_path, n, (spath, _langs(cfg), cfg.normaliser), p, verbose)
        lex = _lexicon(counted, p, k, n_frequent, identity, verbose)
    meta = {"score": "dice", "k": k, "frequent": n_frequent, "identity": identity, "lines": n,
            "src": os.path.basename(src_path), "tgt": os.path.basename(tgt_path)}
    path = modeldir.write_shortlist(model_dir, *lex, metadata=meta)
    listed = (lex.offsets[1:] > lex.offsets[:-1]).sum()
    return {"path": path, **meta, "pairs": lex.ids.numel(), "source_tokens_with_list": int(listed),
            "seconds": round(time.time() - t0, 1)}


def _line_count(path: str) -> int:
    """Lines as student.data reads them, counted in bounded memory; one DataError for a bad file."""
    lines = Lines(path)  # a missing file fails here
    try:
        return textio.count_lines(path)
    except (OSError, EOFError, zlib.error):
        for _ in lines:  # names the failure as every reader of the corpus does
            pass
        raise


def _count_files(src_path: str, tgt_path: str, n: int, setup: tuple, p: cooc.Plan, verbose: bool):
    """The first pass over the first n pairs of two line-aligned files: (chunks, totals)."""
    pairs = itertools.islice(zip(Lines(src_path), Lines(tgt_path)), n)
    with tqdm(total=n, desc="shortlist: counting", unit="pair", unit_scale=True, delay=1,
              disable=not verbose) as bar:
        def tasks():
            for i in range(-(-n // CHUNK)):
                chunk = list(itertools.islice(pairs, CHUNK))
                bar.update(len(chunk))
                yield i, chunk, p
        n_workers = workers() if os.path.getsize(src_path) > POOL_BYTES else 1
        return cooc.totals(imap_ordered(_encode_count, tasks(), n_workers, _setup, setup), p.vocab)
