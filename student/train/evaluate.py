"""Greedy translation for dev/test BLEU during training, and BLEU/chrF with sacrebleu.

`translate` is the plain reference path (the training model, no cache);
`translate_lean` writes the current weights as a model dir and runs the lean
decoder on it: the same greedy tokens (tests/test_decoder_trained.py checks the
two decoders agree) in a fraction of the time, so dev evaluations stop eating
the training budget's wall time.
"""
from __future__ import annotations

import os

import sacrebleu
import torch

from decoder import Translator
from decoder.batching import pack
from student.modeldir import write_model_dir
from student.train.batching import collate


def encode_source(sp, lines: list[str], norm, eos_id: int, max_len: int) -> list[list[int]]:
    out = []
    for line in lines:
        ids = sp.encode(norm(line))[: max_len - 1]
        out.append(ids + [eos_id])
    return out


@torch.no_grad()
def translate(model, sp, lines: list[str], norm, max_tokens: int = 6000, max_sentences: int = 128,
              amp_dtype=None) -> list[str]:
    a = model.args
    was_training = model.training
    model.eval()
    src = encode_source(sp, lines, norm, a.eos_id, a.max_positions // 2)
    lens = [len(x) for x in src]
    out: list[str] = [""] * len(lines)
    for idx in pack(sorted(range(len(src)), key=lens.__getitem__), lens, max_tokens, max_sentences):
        s, _, _ = collate(src, None, idx, a.pad_id, a.decoder_start_id, a.eos_id)
        with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
            hyps = model.greedy(s.to(next(model.parameters()).device))
        for j, h in zip(idx, hyps):
            out[j] = sp.decode(h) if lines[j].strip() else ""
    model.train(was_training)
    return out


@torch.no_grad()
def translate_lean(model, meta: dict, lines: list[str], work_dir: str) -> list[str]:
    d = write_model_dir(model, meta["spm_model"], os.path.join(work_dir, "dev-model"), meta)
    device = next(model.parameters()).device
    # fp32 and no process-wide allocator setting: this runs inside the trainer
    tr = Translator(d, device=device.type, precision="fp32", retain_memory=False, pipeline=False)
    return tr.translate(lines)


def score(hyps: list[str], refs: list[str]) -> dict:
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hyps, [refs])
    c = chrf.corpus_score(hyps, [refs])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2),
            "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature())}
