"""Model dir <-> Hugging Face M2M100, on identical weights.

    to_hf(model_dir) -> (M2M100ForConditionalGeneration, ModelConfig)   in memory
    save_hf(model_dir, out_dir)          a directory AutoModelForSeq2SeqLM / AutoTokenizer load
    from_hf(hf_dir, out_dir)             an M2M100-architecture checkpoint -> our model dir

Our tensors carry M2M100's names minus "model.", and our architecture is
M2M100's (pre-norm, fairseq sinusoidal positions from row pad_id + 1,
embeddings scaled by sqrt(d_model)), so both directions are renames.
"""
from __future__ import annotations

import os
import pickle
import shutil
import warnings

import torch

from decoder import durable, modeldir

from .spm_tokenizer import hf_tokenizer
from .usage import read_kit, write_usage

# what an HF dir's SentencePiece model may be called (ours, fairseq/M2M100's, T5's)
SPM_NAMES = (modeldir.SPM, "sentencepiece.bpe.model", "spiece.model")


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


def generation_config(cfg: modeldir.ModelConfig):
    """Greedy from our start token; max_length = the longest output our decoder allows
    (start + max_positions - 2 tokens + </s>); the per-line cap has no HF setting."""
    from transformers import GenerationConfig
    return GenerationConfig(decoder_start_token_id=cfg.decoder_start_id, bos_token_id=cfg.bos_id,
                            eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id, forced_bos_token_id=None,
                            num_beams=1, do_sample=False, length_penalty=1.0, min_length=0,
                            max_length=cfg.arch.max_positions)


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
    model.generation_config = generation_config(cfg)
    return model, cfg


def save_hf(model_dir: str, out_dir: str) -> str:
    """An HF directory: safetensors weights, config.json, generation_config.json, tokenizer
    files (tokenizer.json: SentencePiece ids + </s>), spm.model, kit.json and README.md."""
    model, cfg = to_hf(model_dir)
    spm_path = os.path.join(model_dir, modeldir.SPM)
    tok = hf_tokenizer(spm_path, cfg.bos_id, cfg.pad_id, cfg.eos_id, cfg.unk_id, cfg.arch.max_positions)

    def write(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        shutil.copyfile(spm_path, os.path.join(tmp, modeldir.SPM))
        write_usage(tmp, out_dir, cfg, "hf")
    durable.write_dir(out_dir, write)
    return out_dir


def _hf_configs(hf_dir: str):
    """The dir's model and generation configs, checked to be an M2M100 the decoder runs."""
    from transformers import AutoConfig, GenerationConfig

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(f"{hf_dir}: no config.json (not a Hugging Face model dir)")
    try:  # bounded and fully checked before transformers reads it (no limit there)
        raw = modeldir.read_json(os.path.join(hf_dir, "config.json"))
    except modeldir.ModelDirError as e:
        raise ValueError(str(e)) from None
    if not isinstance(raw, dict) or "model_type" not in raw:  # e.g. one of our model dirs, the wrong way round
        raise ValueError(f"{hf_dir}: config.json has no model_type, so not a Hugging Face model dir "
                         "(a kit model dir converts the other way: --to hf)")
    hc = AutoConfig.from_pretrained(hf_dir)
    try:
        gc = GenerationConfig.from_pretrained(hf_dir)
    except OSError:  # no generation_config.json: the model config's own values
        gc = GenerationConfig.from_model_config(hc)
    _check_m2m100(hc, gc, os.path.join(hf_dir, "config.json"))
    return hc, gc


def _model_config(hf_dir: str, hc, gc, spm_path: str, src_lang: str | None, tgt_lang: str | None):
    """Our config.json's contents for the HF configs; languages and normaliser from the
    dir's kit.json where the arguments do not give them."""
    kit = read_kit(hf_dir)
    src_lang = src_lang or kit.get("languages", {}).get("src")
    tgt_lang = tgt_lang or kit.get("languages", {}).get("tgt")
    if not (src_lang and tgt_lang):
        raise ValueError(f"{hf_dir}: no kit.json with the languages; pass --src-lang and --tgt-lang")
    start = gc.decoder_start_token_id if gc.decoder_start_token_id is not None else hc.decoder_start_token_id
    arch = modeldir.Arch(vocab_size=hc.vocab_size, d_model=hc.d_model, n_heads=hc.encoder_attention_heads,
                         ffn_dim=hc.encoder_ffn_dim, encoder_layers=hc.encoder_layers,
                         decoder_layers=hc.decoder_layers, max_positions=hc.max_position_embeddings,
                         activation=hc.activation_function, tie_embeddings=bool(hc.tie_word_embeddings))
    cfg = modeldir.ModelConfig(arch=arch, bos_id=hc.bos_token_id, pad_id=hc.pad_token_id, eos_id=hc.eos_token_id,
                               unk_id=_unk_id(spm_path), decoder_start_id=start, src_lang=src_lang,
                               tgt_lang=tgt_lang, normaliser=kit.get("normaliser", {}),
                               provenance={"converted_from": os.path.basename(os.path.abspath(hf_dir)),
                                           "hf_model_type": hc.model_type})
    modeldir.check_config(cfg.to_json(), os.path.join(hf_dir, "config.json"))
    return cfg


def _check_m2m100(hc, gc, where: str) -> None:
    """Refuse what our decoder does not implement, naming the setting."""
    from transformers import M2M100Config

    def need(ok, what):
        if not ok:
            raise ValueError(f"{where}: {what}, which the decoder does not implement (it implements M2M100)")
    need(hc.model_type == M2M100Config.model_type, f"model_type is {hc.model_type!r}")
    need(hc.scale_embedding, "scale_embedding is false")
    need(hc.activation_function in ("relu", "gelu"), f"activation_function is {hc.activation_function!r}")
    need(hc.encoder_attention_heads == hc.decoder_attention_heads, "encoder and decoder head counts differ")
    need(hc.encoder_ffn_dim == hc.decoder_ffn_dim, "encoder and decoder FFN sizes differ")
    need(gc.forced_bos_token_id is None, f"generation forces a first token ({gc.forced_bos_token_id})")


def _find_spm(hf_dir: str, spm_path: str | None) -> str:
    if spm_path:
        return spm_path
    for name in SPM_NAMES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            if os.path.isfile(os.path.join(hf_dir, "vocab.json")):
                raise ValueError(f"{hf_dir}: vocab.json (M2M100Tokenizer) maps ids differently from "
                                 f"{name}; our decoder reads SentencePiece ids directly (pass --spm with a "
                                 f"model whose ids are the checkpoint's)")
            return os.path.join(hf_dir, name)
    raise ValueError(f"{hf_dir}: no SentencePiece model ({', '.join(SPM_NAMES)}); pass one with --spm")


def from_hf(hf_dir: str, out_dir: str, spm_path: str | None = None,
            src_lang: str | None = None, tgt_lang: str | None = None) -> str:
    """Our model dir from an M2M100-architecture HF checkpoint whose token ids are the
    SentencePiece model's ids (as save_hf writes them). Languages and normaliser come
    from the dir's kit.json when it has one, else from the arguments (no normaliser)."""
    from safetensors.torch import save_file
    from transformers import M2M100ForConditionalGeneration

    hc, gc = _hf_configs(hf_dir)
    spm_path = _find_spm(hf_dir, spm_path)
    cfg = _model_config(hf_dir, hc, gc, spm_path, src_lang, tgt_lang)
    model = _load_hf_model(M2M100ForConditionalGeneration, hf_dir)
    sd = {k.removeprefix("model."): v.float().contiguous() for k, v in model.state_dict().items()}
    for side in ("encoder", "decoder"):  # one input embedding for both sides, as fairseq's M2M100 has
        k = f"{side}.embed_tokens.weight"
        if k in sd and not torch.equal(sd[k], sd["shared.weight"]):
            raise ValueError(f"{hf_dir}: model.{k} differs from model.shared.weight; "
                             f"the decoder has one embedding for source and target")
    want = modeldir.tensor_shapes(cfg.arch)
    weights = {k: sd[k].clone() for k in want}  # the rest: tied copies and computed position tables

    def write(tmp):
        save_file(weights, os.path.join(tmp, modeldir.WEIGHTS))
        shutil.copyfile(spm_path, os.path.join(tmp, modeldir.SPM))
        durable.write_json(os.path.join(tmp, modeldir.CONFIG), cfg.to_json())
        modeldir.load(tmp)  # the contract, checked before the dir is published
    durable.write_dir(out_dir, write)
    return out_dir


def _load_hf_model(cls, hf_dir: str):
    """cls.from_pretrained(hf_dir), or a ValueError naming the weights file: a truncated or
    corrupt file raises SafetensorError (or OSError, RuntimeError, EOFError for a .bin)."""
    from safetensors import SafetensorError
    names = [n for n in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(hf_dir, n))]
    where = os.path.join(hf_dir, names[0]) if names else hf_dir
    try:
        with warnings.catch_warnings():  # torch warns about a planted pickle's protocol before refusing it
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return cls.from_pretrained(hf_dir)
    except pickle.UnpicklingError:  # transformers loads a .bin weights-only: a planted pickle stops here
        raise ValueError(f"{where}: refused: not a weights-only torch checkpoint "
                         f"(arbitrary pickles are never loaded)") from None
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as e:
        if modeldir.is_allocation_failure(e):
            raise ValueError(f"{where}: not enough memory to load the weights ({modeldir.first_line(e)})") from None
        raise ValueError(f"{where}: unreadable weights ({modeldir.first_line(e)})") from None


def _unk_id(spm_path: str) -> int:
    import sentencepiece as spm
    try:
        return spm.SentencePieceProcessor(model_file=spm_path).unk_id()
    except Exception as e:  # sentencepiece raises OSError/RuntimeError variously
        raise ValueError(f"{spm_path}: unreadable SentencePiece model ({str(e).splitlines()[0]})") from None
