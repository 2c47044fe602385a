"""Convert a model dir to CTranslate2 or Hugging Face, or an HF M2M100 checkpoint to a model dir.

    python -m tools.convert --to ct2 MODEL_DIR OUT_DIR [--quantization int8]
    python -m tools.convert --to hf MODEL_DIR OUT_DIR
    python -m tools.convert --from-hf HF_DIR OUT_MODEL_DIR [--spm SPM] [--src-lang L --tgt-lang L]
"""
from __future__ import annotations

import argparse
import os
import sys

from decoder import cliargs, durable, fileerrors
from decoder.modeldir import ModelDirError

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int16", "float16", "bfloat16")


def parse_args(argv=None):
    p = cliargs.ArgumentParser(prog="python -m tools.convert", description=__doc__.split("\n\n")[0])
    cliargs.add_version(p)
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["ct2", "hf"], help="convert the model dir IN_DIR to this engine's format")
    way.add_argument("--from-hf", action="store_true",
                     help="convert an M2M100-architecture HF dir (ids = its SentencePiece model's) to a model dir")
    p.add_argument("src", metavar="IN_DIR", help="model dir (--to) or HF dir (--from-hf)")
    p.add_argument("out", metavar="OUT_DIR", help="directory to write; must not exist unless --force")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="--to ct2: weights quantised on disk; None = float32, exact")
    p.add_argument("--spm", default=None, help="--from-hf: SentencePiece model; None = the one in IN_DIR")
    p.add_argument("--src-lang", default=None, help="--from-hf: source language; None = IN_DIR's kit.json")
    p.add_argument("--tgt-lang", default=None, help="--from-hf: target language; None = IN_DIR's kit.json")
    a = p.parse_args(argv)
    if a.quantization and a.to != "ct2":
        p.error("--quantization applies to --to ct2 only")
    if not a.from_hf and (a.spm or a.src_lang or a.tgt_lang):
        p.error("--spm, --src-lang and --tgt-lang apply to --from-hf only")
    return a


def _within(path: str, out: str) -> bool:
    """Whether `path` is `out` or lies inside it (replacing out would delete it)."""
    p, o = os.path.realpath(path), os.path.realpath(out)
    return p == o or p.startswith(o.rstrip(os.sep) + os.sep)


def options(argv) -> argparse.Namespace:
    """The parsed options, checked before any work (IN_DIR a directory, OUT_DIR new unless
    --force and not IN_DIR itself); a bad one is one `error:` line and exit 2 (SystemExit),
    as argparse's own errors."""
    a = parse_args(argv)
    why = None
    if not os.path.isdir(a.src):
        why = f"{a.src}: no such directory"
    elif _within(a.src, a.out):
        why = f"{a.out}: the output would replace the input"
    elif os.path.lexists(a.out) and not a.force:
        why = f"{a.out}: exists (--force replaces it)"
    elif a.spm and not os.path.isfile(a.spm):
        why = f"--spm {a.spm}: no such file"
    else:
        why = cliargs.out_dir_error(None, a.out)
    if why:
        cliargs.refuse(why)
    return a


@fileerrors.one_line
def main(argv=None) -> int:
    try:
        a = options(argv)
    except cliargs.Refused:
        return 2
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # stderr keeps to warnings and the one error line
    except ImportError:  # --to ct2 needs only ctranslate2; the HF directions say so below
        pass
    from tools.convert import from_hf, save_hf, to_ctranslate2
    durable.remove_stale_beside(a.out)  # the temp dirs of a conversion that was killed
    try:
        if a.from_hf:
            from_hf(a.src, a.out, spm_path=a.spm, src_lang=a.src_lang, tgt_lang=a.tgt_lang)
        elif a.to == "ct2":
            to_ctranslate2(a.src, a.out, quantization=a.quantization)
        else:
            save_hf(a.src, a.out)
    except ImportError as e:
        print(f"error: this conversion needs {e.name or e} (pip install ctranslate2 transformers)", file=sys.stderr)
        return 2
    except (ModelDirError, ValueError) as e:  # a failing disk: fileerrors' one line
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    print(a.out)
    return 0


def cli() -> int:
    """`python -m tools.convert` and the `wmt-kit-convert` console script."""
    return cliargs.run(main)


if __name__ == "__main__":
    sys.exit(cli())
