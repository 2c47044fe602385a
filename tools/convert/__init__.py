"""Converters between our model dir (decoder/modeldir.py) and other engines, on identical weights.

    to_ctranslate2(model_dir, out_dir, quantization=None)   CTranslate2 dir (ct2.py)
    to_hf(model_dir) -> (M2M100ForConditionalGeneration, ModelConfig)   in memory (hf.py)
    save_hf(model_dir, out_dir)                             HF dir with tokenizer (hf.py)
    from_hf(hf_dir, out_dir, ...)                           M2M100 checkpoint -> model dir (hf.py)

The command line is `python -m tools.convert` (__main__.py); converted dirs carry
kit.json and README.md with the settings that reproduce `python -m decoder` (usage.py).
"""
from .ct2 import to_ctranslate2
from .hf import from_hf, hf_config, save_hf, to_hf
from .usage import max_decoding_length

__all__ = ["to_ctranslate2", "to_hf", "save_hf", "from_hf", "hf_config", "max_decoding_length"]
