"""Model dir -> other engines, on identical weights (for the benchmark and tests).

    to_ctranslate2(model_dir, out_dir, quantization=None)   CTranslate2 TransformerSpec
    to_hf(model_dir) -> (M2M100ForConditionalGeneration, ModelConfig)

Both follow load -> validate -> save: the CTranslate2 mapping is the one of its
M2M100 loader (ctranslate2/converters/transformers.py: BartLoader with
pre-norm, no embedding LayerNorm, position table from row pad_id + 1), and the
HF model is M2M100 itself, whose names our tensors already use (minus "model.").
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import torch

from decoder import durable, modeldir
from decoder.modeldir import sinusoidal_table


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy()


def to_ctranslate2(model_dir: str, out_dir: str, quantization: str | None = None) -> str:
    import ctranslate2
    import sentencepiece as spm
    from ctranslate2.specs import common_spec, transformer_spec

    cfg, w, spm_path = modeldir.load(model_dir)
    a = cfg.arch
    act = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[a.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (a.encoder_layers, a.decoder_layers), a.n_heads, pre_norm=True, activation=act,
        layernorm_embedding=False)

    def linear(s, p, bias=True):
        s.weight = _np(w[f"{p}.weight"])
        if bias:
            s.bias = _np(w[f"{p}.bias"])

    def norm(s, p):
        s.gamma, s.beta = _np(w[f"{p}.weight"]), _np(w[f"{p}.bias"])

    def fused(s, p, names):
        s.weight = np.concatenate([_np(w[f"{p}.{n}.weight"]) for n in names])
        s.bias = np.concatenate([_np(w[f"{p}.{n}.bias"]) for n in names])

    # CT2 counts positions from 0; our first position is row pad_id + 1 of the fairseq table
    table = sinusoidal_table(a.max_positions + cfg.pad_id + 1, a.d_model, cfg.pad_id)
    for stack, name in ((spec.encoder, "encoder"), (spec.decoder, "decoder")):
        stack.scale_embeddings = float(np.sqrt(a.d_model))
        stack.position_encodings.encodings = _np(table[cfg.pad_id + 1:])
        emb = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        emb.weight = _np(w["shared.weight"])
        norm(stack.layer_norm, f"{name}.layer_norm")
    for i, L in enumerate(spec.encoder.layer):
        p = f"encoder.layers.{i}"
        fused(L.self_attention.linear[0], f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"))
        linear(L.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(L.self_attention.layer_norm, f"{p}.self_attn_layer_norm")
        linear(L.ffn.linear_0, f"{p}.fc1")
        linear(L.ffn.linear_1, f"{p}.fc2")
        norm(L.ffn.layer_norm, f"{p}.final_layer_norm")
    for i, L in enumerate(spec.decoder.layer):
        p = f"decoder.layers.{i}"
        fused(L.self_attention.linear[0], f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"))
        linear(L.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(L.self_attention.layer_norm, f"{p}.self_attn_layer_norm")
        fused(L.attention.linear[0], f"{p}.encoder_attn", ("q_proj",))
        fused(L.attention.linear[1], f"{p}.encoder_attn", ("k_proj", "v_proj"))
        linear(L.attention.linear[2], f"{p}.encoder_attn.out_proj")
        norm(L.attention.layer_norm, f"{p}.encoder_attn_layer_norm")
        linear(L.ffn.linear_0, f"{p}.fc1")
        linear(L.ffn.linear_1, f"{p}.fc2")
        norm(L.ffn.layer_norm, f"{p}.final_layer_norm")
    spec.decoder.projection.weight = _np(w["shared.weight"] if a.tie_embeddings else w["lm_head.weight"])

    sp = spm.SentencePieceProcessor(model_file=spm_path)
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    spec.config.bos_token = tokens[cfg.bos_id]
    spec.config.eos_token = tokens[cfg.eos_id]
    spec.config.unk_token = tokens[cfg.unk_id]
    spec.config.decoder_start_token = tokens[cfg.decoder_start_id]
    spec.validate()
    spec.optimize(quantization=quantization)
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    spec.save(tmp)
    shutil.copyfile(spm_path, os.path.join(tmp, modeldir.SPM))
    durable.publish_dir(tmp, out_dir)
    assert ctranslate2.__version__  # imported for its spec; keeps linters honest
    return out_dir


def hf_config(cfg: modeldir.ModelConfig):
    from transformers import M2M100Config
    a = cfg.arch
    if abs(a.layer_norm_eps - 1e-5) > 1e-12:
        raise ValueError(f"M2M100 hard-codes LayerNorm eps 1e-5; this model uses {a.layer_norm_eps}")
    return M2M100Config(
        vocab_size=a.vocab_size, d_model=a.d_model, max_position_embeddings=a.max_positions,
        encoder_layers=a.encoder_layers, decoder_layers=a.decoder_layers,
        encoder_attention_heads=a.n_heads, decoder_attention_heads=a.n_heads,
        encoder_ffn_dim=a.ffn_dim, decoder_ffn_dim=a.ffn_dim, activation_function=a.activation,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, scale_embedding=True,
        pad_token_id=cfg.pad_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id,
        decoder_start_token_id=cfg.decoder_start_id, tie_word_embeddings=a.tie_embeddings)


def to_hf(model_dir: str):
    """M2M100ForConditionalGeneration with our weights (positions: M2M100 puts the
    first token at row padding_idx + 1 = 2 of the same fairseq table)."""
    from transformers import M2M100ForConditionalGeneration

    cfg, w, _ = modeldir.load(model_dir)
    model = M2M100ForConditionalGeneration(hf_config(cfg)).eval()
    sd = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in w.items()}
    if cfg.arch.tie_embeddings:
        sd["lm_head.weight"] = w["shared.weight"]
    sd["model.encoder.embed_tokens.weight"] = w["shared.weight"]
    sd["model.decoder.embed_tokens.weight"] = w["shared.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # what is left are the computed position tables (buffers)
    bad = [k for k in missing if "embed_positions" not in k] + list(unexpected)
    if bad:
        raise ValueError(f"HF M2M100 does not match the model dir: {bad[:5]}")
    model.generation_config.forced_bos_token_id = None
    return model, cfg
