"""The training-time model <-> a model dir (decoder/modeldir.py is the contract).

    write_model_dir(model, "runs/x/spm.model", "runs/x/model", meta)   # Transformer -> dir
    model, cfg = load_model_dir("runs/x/model")                        # dir -> Transformer

One module for both directions, used by the trainer (dev BLEU through the lean
decoder, initialising a student from its teacher) and by the exporter
(student/export.py: checkpoint -> model dir); it imports neither of them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

from safetensors.torch import save

from decoder import durable, modeldir
from student.model import ModelArgs, Transformer


def model_config(args: ModelArgs, meta: dict, provenance: dict | None = None) -> modeldir.ModelConfig:
    return modeldir.ModelConfig(
        arch=modeldir.Arch(**args.arch_dict()),
        bos_id=meta.get("bos_id", 0), pad_id=args.pad_id, eos_id=args.eos_id,
        unk_id=meta.get("unk_id", 3), decoder_start_id=args.decoder_start_id,
        src_lang=meta.get("src_lang", "src"), tgt_lang=meta.get("tgt_lang", "tgt"),
        normaliser=meta.get("normaliser", {}), provenance=provenance or {})


def write_model_dir(model: Transformer, spm_path: str, out_dir: str, meta: dict,
                    provenance: dict | None = None) -> str:
    """Write config.json + model.safetensors + spm.model into a temporary sibling dir,
    validate it with the decoder's own loader, then rename it into place, so a
    half-written model dir never exists under out_dir."""
    def write(tmp: str) -> None:
        cfg = model_config(model.args, meta, provenance)
        with open(os.path.join(tmp, modeldir.CONFIG), "w", encoding="utf-8") as fh:
            json.dump(cfg.to_json(), fh, indent=2, ensure_ascii=False)
        # contiguous fp32 copies: tied weights share storage, safetensors refuses aliases
        sd = {k: v.detach().float().contiguous().clone() for k, v in model.state_dict().items()}
        durable.write_bytes(os.path.join(tmp, modeldir.WEIGHTS), save(sd, metadata={"format": "pt"}))
        shutil.copyfile(modeldir.spm_file(spm_path), os.path.join(tmp, modeldir.SPM))
        modeldir.load(tmp)  # refuse to publish a dir the decoder cannot read
    return durable.write_dir(os.path.abspath(out_dir), write)


def checked_args(fields, where: str, base: dict | None = None) -> ModelArgs:
    """ModelArgs of `fields` over `base` (a preset's), or a ValueError naming `where`: every key a
    model field, the dropouts probabilities, and the model one the decoder's schema accepts
    (decoder/modeldir.py: the sizes and their upper bounds). Checked before any tensor exists:
    --set, and the model_args of a checkpoint, which could ask for any size."""
    known = [f.name for f in dataclasses.fields(ModelArgs)]
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: must be a table of model fields, got {type(fields).__name__}")
    for k, v in fields.items():
        if k not in known:
            raise ValueError(f"{where} {str(k)[:40]}: not a model field (known: {', '.join(known)})")
        if not isinstance(v, (bool, int, float, str)):  # a checkpoint's pickle may hold any tensor or table
            raise ValueError(f"{where} {k}: must be a number, a string or true/false, got {type(v).__name__}")
    args = ModelArgs(**{**(base or {}), **fields})
    for k in ("dropout", "attention_dropout"):
        v = getattr(args, k)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1):
            raise ValueError(f"{where} {k}: must be a number in [0, 1), got {json.dumps(v)[:40]}")
    cfg = modeldir.ModelConfig(arch=modeldir.Arch(**args.arch_dict()), pad_id=args.pad_id, eos_id=args.eos_id,
                               decoder_start_id=args.decoder_start_id, bos_id=0, unk_id=0).to_json()
    try:
        modeldir.check_config(cfg, where=where)
    except modeldir.ModelDirError as e:
        raise ValueError(str(e)) from None
    return args


def model_args(cfg: modeldir.ModelConfig) -> ModelArgs:
    """The training-time arguments of a model dir's config (model_config's inverse)."""
    a = cfg.arch
    return ModelArgs(vocab_size=a.vocab_size, d_model=a.d_model, n_heads=a.n_heads, ffn_dim=a.ffn_dim,
                     encoder_layers=a.encoder_layers, decoder_layers=a.decoder_layers,
                     max_positions=a.max_positions, activation=a.activation,
                     tie_embeddings=a.tie_embeddings, layer_norm_eps=a.layer_norm_eps,
                     pad_id=cfg.pad_id, eos_id=cfg.eos_id, decoder_start_id=cfg.decoder_start_id)


def load_model_dir(model_dir: str) -> tuple[Transformer, modeldir.ModelConfig]:
    """Model dir -> training-time model (for continued training and round-trip tests)."""
    cfg, weights, _ = modeldir.load(model_dir)
    model = Transformer(model_args(cfg))
    model.load_state_dict(weights, strict=True)
    return model.eval(), cfg
