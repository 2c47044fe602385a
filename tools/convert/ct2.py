"""Model dir -> CTranslate2 model dir, on identical weights.

The mapping is the one of CTranslate2's M2M100 loader
(ctranslate2/converters/transformers.py: BartLoader with pre-norm, no embedding
LayerNorm, position table from row pad_id + 1). The dir is for plain CT2 use:
config.json appends </s> to the source (add_source_eos), and kit.json + README.md
next to it give the normaliser and the length cap that reproduce `python -m decoder`.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import torch

from decoder import durable, modeldir
from decoder.modeldir import sinusoidal_table

from .usage import write_usage


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy()


def to_ctranslate2(model_dir: str, out_dir: str, quantization: str | None = None) -> str:
    import ctranslate2

    cfg, w, spm_path = modeldir.load(model_dir)
    spec = _spec(cfg, w)
    _vocabulary(spec, cfg, spm_path)
    spec.validate()
    spec.optimize(quantization=quantization)

    def write(tmp: str) -> None:
        spec.save(tmp)
        shutil.copyfile(spm_path, os.path.join(tmp, modeldir.SPM))
        write_usage(tmp, out_dir, cfg, "ct2", ctranslate2=ctranslate2.__version__, quantization=quantization)
    durable.write_dir(out_dir, write)
    return out_dir


def _spec(cfg, w):
    """A TransformerSpec holding the weights `w` of a model dir with config `cfg`."""
    from ctranslate2.specs import common_spec, transformer_spec

    a = cfg.arch
    act = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[a.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (a.encoder_layers, a.decoder_layers), a.n_heads, pre_norm=True, activation=act,
        layernorm_embedding=False)
    # CT2 counts positions from 0; our first position is row pad_id + 1 of the fairseq table
    table = sinusoidal_table(a.max_positions + cfg.pad_id + 1, a.d_model, cfg.pad_id)
    for stack, name in ((spec.encoder, "encoder"), (spec.decoder, "decoder")):
        stack.scale_embeddings = float(np.sqrt(a.d_model))
        stack.position_encodings.encodings = _np(table[cfg.pad_id + 1:])
        emb = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        emb.weight = _np(w["shared.weight"])
        _norm(stack.layer_norm, w, f"{name}.layer_norm")
    for i, L in enumerate(spec.encoder.layer):
        _self_attention_and_ffn(L, w, f"encoder.layers.{i}")
    for i, L in enumerate(spec.decoder.layer):
        p = f"decoder.layers.{i}"
        _self_attention_and_ffn(L, w, p)
        _fused(L.attention.linear[0], w, f"{p}.encoder_attn", ("q_proj",))
        _fused(L.attention.linear[1], w, f"{p}.encoder_attn", ("k_proj", "v_proj"))
        _linear(L.attention.linear[2], w, f"{p}.encoder_attn.out_proj")
        _norm(L.attention.layer_norm, w, f"{p}.encoder_attn_layer_norm")
    spec.decoder.projection.weight = _np(w["shared.weight"] if a.tie_embeddings else w["lm_head.weight"])
    return spec


def _self_attention_and_ffn(L, w, p: str) -> None:
    _fused(L.self_attention.linear[0], w, f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"))
    _linear(L.self_attention.linear[1], w, f"{p}.self_attn.out_proj")
    _norm(L.self_attention.layer_norm, w, f"{p}.self_attn_layer_norm")
    _linear(L.ffn.linear_0, w, f"{p}.fc1")
    _linear(L.ffn.linear_1, w, f"{p}.fc2")
    _norm(L.ffn.layer_norm, w, f"{p}.final_layer_norm")


def _linear(s, w, p: str) -> None:
    s.weight, s.bias = _np(w[f"{p}.weight"]), _np(w[f"{p}.bias"])


def _norm(s, w, p: str) -> None:
    s.gamma, s.beta = _np(w[f"{p}.weight"]), _np(w[f"{p}.bias"])


def _fused(s, w, p: str, names) -> None:
    s.weight = np.concatenate([_np(w[f"{p}.{n}.weight"]) for n in names])
    s.bias = np.concatenate([_np(w[f"{p}.{n}.bias"]) for n in names])


def _vocabulary(spec, cfg, spm_path: str) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spm_path)
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    spec.config.bos_token = tokens[cfg.bos_id]
    spec.config.eos_token = tokens[cfg.eos_id]
    spec.config.unk_token = tokens[cfg.unk_id]
    spec.config.decoder_start_token = tokens[cfg.decoder_start_id]
    spec.config.add_source_eos = True  # our sources end in </s>; CT2 appends it for the user
    spec.config.add_source_bos = False

