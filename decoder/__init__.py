"""Lean decoder for model dirs (decoder/modeldir.py): `Translator(model_dir).translate(lines)`."""


def __getattr__(name):
    # lazy: `python -m decoder` reports a bad model dir without paying for torch twice
    if name in ("Translator", "Options"):
        from . import translator
        return getattr(translator, name)
    raise AttributeError(name)
