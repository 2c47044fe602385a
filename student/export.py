"""Checkpoint -> model dir (decoder/modeldir.py is the contract).

    python -m student.export runs/x/teacher/best.pt runs/x/teacher/model

Loads the checkpoint, writes config.json + model.safetensors + spm.model into a
temporary sibling dir, validates it with the decoder's own loader, then renames
it into place, so a half-written model dir never exists under OUT_DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import warnings

import torch
from safetensors.torch import save_file

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
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        cfg = model_config(model.args, meta, provenance)
        with open(os.path.join(tmp, modeldir.CONFIG), "w", encoding="utf-8") as fh:
            json.dump(cfg.to_json(), fh, indent=2, ensure_ascii=False)
        # contiguous fp32 copies: tied weights share storage, safetensors refuses aliases
        sd = {k: v.detach().float().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(sd, os.path.join(tmp, modeldir.WEIGHTS), metadata={"format": "pt"})
        shutil.copyfile(spm_path, os.path.join(tmp, modeldir.SPM))
        modeldir.load(tmp)  # refuse to publish a dir the decoder cannot read
        durable.publish_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


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


class CheckpointError(ValueError):
    """A file that is not a student.train checkpoint; str(e) is one line naming it."""


def read_checkpoint(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol before refusing
            warnings.simplefilter("ignore", UserWarning)
            # our own checkpoints only; weights_only refuses arbitrary pickled code
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"{path}: refused: not a weights-only torch checkpoint "
                              f"(arbitrary pickles are never loaded)") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"{path}: not a torch checkpoint ({why})") from None
    missing = [k for k in ("model_args", "model", "meta") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a student.train checkpoint (no {missing[0]!r})")
    return ckpt


def export_checkpoint(ckpt_path: str, out_dir: str) -> str:
    ckpt = read_checkpoint(ckpt_path)
    args = ModelArgs(**ckpt["model_args"])
    model = Transformer(args)
    model.load_state_dict(ckpt["model"])
    meta = ckpt["meta"]
    provenance = {"checkpoint": os.path.abspath(ckpt_path), "step": ckpt.get("step"),
                  "preset": meta.get("preset"), "torch": torch.__version__,
                  "dev_bleu": ckpt.get("best_bleu")}
    return write_model_dir(model, meta["spm_model"], out_dir, meta, provenance)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m student.export",
                                description="Write a model dir (config.json, model.safetensors, "
                                            "spm.model) from a student.train checkpoint.")
    p.add_argument("checkpoint", help="checkpoint written by student.train (best.pt / last.pt)")
    p.add_argument("out_dir", help="model dir to create (replaced atomically if it exists)")
    a = p.parse_args(argv)
    try:
        out = export_checkpoint(a.checkpoint, a.out_dir)
    except (CheckpointError, FileNotFoundError, KeyError, modeldir.ModelDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
