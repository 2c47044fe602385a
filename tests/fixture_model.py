"""A randomly initialised model dir in the contract format (decoder/modeldir.py)."""
from __future__ import annotations

import json
import math
import os
import random

import torch
from safetensors.torch import save_file

from decoder import modeldir
from student.shape_model import random_weights  # noqa: F401  (tests import it from here)

WORDS = ("the a man woman house dog cat sees has big small red green old new city king word "
         "light water earth heaven said unto them and was were people land son day god lord").split()


def synthetic_corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 14))]
        if rng.random() < 0.3:
            words[-1] += rng.choice([".", ",", "!", "?", ";"])
        if rng.random() < 0.2:
            words.insert(0, rng.choice(["Él", "ñandú", "«", "Ça", "2024", "naïve"]))
        lines.append(" ".join(words))
    return lines


def train_spm(path: str, vocab_size: int, seed: int = 0) -> str:
    import sentencepiece as spm
    os.makedirs(path, exist_ok=True)
    text = os.path.join(path, "spm-train.txt")
    with open(text, "w", encoding="utf-8") as fh:
        fh.write("\n".join(synthetic_corpus(2000, seed)) + "\n")
    prefix = os.path.join(path, "spm")
    spm.SentencePieceTrainer.train(
        input=text, model_prefix=prefix, vocab_size=vocab_size, model_type="unigram",
        bos_id=0, pad_id=1, eos_id=2, unk_id=3, byte_fallback=True, character_coverage=1.0,
        hard_vocab_limit=False, minloglevel=2, num_threads=1)
    os.remove(text)
    return prefix + ".model"


def make_model_dir(path, *, vocab_size: int = 500, d_model: int = 64, enc: int = 2, dec: int = 2,
                   n_heads: int = 4, ffn_dim: int | None = None, seed: int = 0,
                   tie_embeddings: bool = False, normaliser: dict | None = None,
                   max_positions: int = 1024) -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    spm_path = train_spm(os.path.join(path, ".spm"), vocab_size, seed)
    import sentencepiece as spm
    vocab_size = spm.SentencePieceProcessor(model_file=spm_path).get_piece_size()
    a = modeldir.Arch(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
                      ffn_dim=ffn_dim or 4 * d_model, encoder_layers=enc, decoder_layers=dec,
                      max_positions=max_positions, tie_embeddings=tie_embeddings)
    norm = {"type": "moses-punct", "src_lang": "en", "tgt_lang": "es", "penn": True,
            "norm_quote_commas": True, "norm_numbers": True, "pre_replace_unicode_punct": True,
            "post_remove_control_chars": True} if normaliser is None else normaliser
    cfg = modeldir.ModelConfig(arch=a, src_lang="en", tgt_lang="es", normaliser=norm,
                               provenance={"fixture": "random", "seed": seed})
    with open(os.path.join(path, modeldir.CONFIG), "w", encoding="utf-8") as fh:
        json.dump(cfg.to_json(), fh, indent=2)
    save_file(random_weights(a, seed), os.path.join(path, modeldir.WEIGHTS))
    os.replace(spm_path, os.path.join(path, modeldir.SPM))
    import shutil
    shutil.rmtree(os.path.join(path, ".spm"))
    return path
