"""python -m student.shortlist --model DIR --src FILE --tgt FILE [--k 100] [--frequent 100]"""
from __future__ import annotations

import json
import sys

from decoder import fileerrors
from decoder.cliargs import (ArgumentParser, HelpFormatter, add_version, file_error, model_dir_error, nonneg_int,
                             positive_int)
from decoder.modeldir import ModelDirError
from student.data import DataError
from student.shortlist import add_to_model_dir


def parse_args(argv=None):
    p = ArgumentParser(
        prog="python -m student.shortlist", formatter_class=HelpFormatter,
        description="Build a lexical shortlist from a parallel corpus (the student's distilled training "
                    "data) and add it to a model dir: shortlist.safetensors, listed in config.json. "
                    "The decoder uses it with --shortlist.")
    add_version(p)
    p.add_argument("--model", required=True, help="model dir (config.json, spm.model); the file is written here")
    p.add_argument("--src", required=True, help="source side of the corpus, one sentence per line (plain or .gz)")
    p.add_argument("--tgt", required=True, help="target side, line-aligned with --src")
    p.add_argument("--k", type=positive_int, default=100, help="target tokens per source token, by Dice (default 100)")
    p.add_argument("--frequent", type=nonneg_int, default=100,
                   help="most frequent target tokens, allowed in every batch (default 100)")
    p.add_argument("--no-identity", dest="identity", action="store_false",
                   help="do not list each source token as its own candidate (copy-through)")
    p.add_argument("--max-lines", type=nonneg_int, default=0, help="use the first N pairs only (0 = all)")
    return p.parse_args(argv)


@fileerrors.one_line
def main(argv=None) -> int:
    a = parse_args(argv)
    why = (model_dir_error("--model", a.model, shortlist=False)  # the file it writes need not be there
           or file_error("--src", a.src) or file_error("--tgt", a.tgt))
    if why:  # before the corpus is read
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        info = add_to_model_dir(a.model, a.src, a.tgt, k=a.k, n_frequent=a.frequent, identity=a.identity,
                                max_lines=a.max_lines, verbose=True)
    except (ModelDirError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
