"""What a converted dir needs besides weights to reproduce `python -m decoder`: the
source normaliser, the length cap and the search settings, written next to the
model as kit.json (for programs) and README.md (for people).

The cap is our decoder's (decoder/translator.py `limits`): with n source tokens
*including* </s>, at most int(a * n + b) - 1 tokens are emitted before </s>,
n capped by max_positions. CT2 and HF take the source without </s> (they add it), so for
m = len(tokens): max_decoding_length (CT2) = max_new_tokens (HF) = int(a * (m + 1) + b) - 1.
"""
from __future__ import annotations

import json
import os

from decoder import durable
from decoder.modeldir import ModelConfig, ModelDirError, moses_options, read_json

KIT = "kit.json"
MAX_LEN_A, MAX_LEN_B = 1.5, 10  # decoder.translator.Options' defaults (python -m decoder --max-len-a/-b)


def max_decoding_length(n_tokens: int, max_positions: int, a: float = MAX_LEN_A, b: int = MAX_LEN_B) -> int:
    """Tokens before </s> our decoder allows for a source of n_tokens SentencePiece pieces (no </s>)."""
    return max(min(int(a * (n_tokens + 1) + b), max_positions - 1), 1) - 1  # as translator.limits: >= 1 step


def normaliser_call(cfg: ModelConfig) -> str:
    """The Python expression that builds the source normaliser, or '' for none."""
    n = cfg.normaliser
    if not n:
        return ""
    kw = "".join(f", {k}={v}" for k, v in moses_options(n).items())
    return f"sacremoses.MosesPunctNormalizer(lang={n.get('src_lang', cfg.src_lang)!r}{kw}).normalize"


_CT2 = """\
import ctranslate2, sacremoses, sentencepiece
normalise = {norm}
sp = sentencepiece.SentencePieceProcessor(model_file="{dir}/spm.model")
translator = ctranslate2.Translator("{dir}", device="cpu")
tokens = [sp.encode(normalise(line), out_type=str) for line in lines]  # skip empty lines: their output is ""
# one cap per line: translate_batch takes one cap per call, so a batch shares the largest one
cap = lambda t: min(int({a} * (len(t) + 1) + {b}), {P} - 1) - 1
out = [translator.translate_batch([t], beam_size={beam}, max_decoding_length=cap(t),
                                  min_decoding_length=0, max_input_length={P})[0]
       for t in tokens]
hyps = [sp.decode(r.hypotheses[0]) for r in out]
"""

_HF = """\
import sacremoses, torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
normalise = {norm}
tok = AutoTokenizer.from_pretrained("{dir}")       # SentencePiece ids + </s>, as the decoder encodes
model = AutoModelForSeq2SeqLM.from_pretrained("{dir}").eval()
batch = tok([normalise(line) for line in lines], return_tensors="pt", padding=True)
# generation_config.json holds start token, beam and max_length = {P}; the per-line cap
# int({a} * (len + 1) + {b}) - 1 has no HF setting (max_new_tokens is one number per call)
out = model.generate(**batch)
hyps = tok.batch_decode(out, skip_special_tokens=True)
"""


def write_usage(out_dir: str, name: str, cfg: ModelConfig, engine: str, **facts) -> None:
    """kit.json and README.md into out_dir, a converted dir to be published as `name`
    (`engine`: "ct2" or "hf")."""
    P = cfg.arch.max_positions
    norm = normaliser_call(cfg)
    kit = {
        "converted_by": "python -m tools.convert",
        "languages": {"src": cfg.src_lang, "tgt": cfg.tgt_lang},
        # the model dir's own entry (decoder/modeldir.py): --from-hf restores it
        "normaliser": cfg.normaliser,
        "normaliser_python": norm or None,
        "source": "normalise, SentencePiece-encode; </s> is appended by the engine",
        "decoding": {"beam_size": 1, "max_len_a": MAX_LEN_A, "max_len_b": MAX_LEN_B,
                     "max_decoding_length": f"min(int({MAX_LEN_A} * (len(tokens) + 1) + {MAX_LEN_B}), {P} - 1) - 1",
                     "min_decoding_length": 0, "max_input_length": P},
        **{k: v for k, v in facts.items() if v is not None},
    }
    durable.write_json(os.path.join(out_dir, KIT), kit)
    code = (_CT2 if engine == "ct2" else _HF).format(norm=norm or "lambda s: s", dir=name,
                                                     a=MAX_LEN_A, b=MAX_LEN_B, P=P, beam=1)
    engine_name = "CTranslate2" if engine == "ct2" else "Hugging Face transformers"
    durable.write_text(os.path.join(out_dir, "README.md"), f"""\
# {cfg.src_lang} -> {cfg.tgt_lang} model for {engine_name}

Converted by `python -m tools.convert --to {engine}`. With fp32 weights, greedy search and the
source normaliser below, this gives the same output as `python -m decoder --precision fp32`
(the decoding settings are in {KIT}: {json.dumps(kit["decoding"])}).

```python
{code}```
""")


def read_kit(d: str) -> dict:
    """kit.json of a converted dir, or {} when there is none."""
    p = os.path.join(d, KIT)
    if not os.path.isfile(p):
        return {}
    try:
        kit = read_json(p, what="kit.json")
    except ModelDirError as e:
        raise ValueError(str(e)) from None
    if not isinstance(kit, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return kit
