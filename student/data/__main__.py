"""python -m student.data prepare [bible-en-es | --src FILE --tgt FILE ...]"""
from __future__ import annotations

import sys

from decoder import fileerrors
from decoder.cliargs import (ArgumentParser, HelpFormatter, add_version, int_range, nonneg_float, nonneg_int,
                             positive_float, positive_int)
from decoder.modeldir import MAX_VOCAB

from . import DataError, prepare


@fileerrors.one_line
def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m student.data",
                        description="Prepare a parallel corpus: clean, split, normalise, SentencePiece.")
    add_version(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", formatter_class=HelpFormatter,
                       description="Clean and split a corpus and train its joint SentencePiece model. "
                       "The result is cached under DATA_DIR/prepared/<name>-<hash>/ (a rerun with the same "
                       "inputs and options is a cache hit). Counts go to stderr; stdout gets the prepared dir.")
    p.add_argument("corpus", nargs="?", default="bible-en-es",
                   help="embedded corpus (bible-en-es, bible-es-en), or a name for --src/--tgt files")
    g = p.add_argument_group("your own parallel files (one sentence per line, plain or .gz)")
    g.add_argument("--src", help="source side; replaces the embedded corpus")
    g.add_argument("--tgt", help="target side, same line count as --src")
    g.add_argument("--src-lang", help="source language code (default: from the file suffix, e.g. corpus.en)")
    g.add_argument("--tgt-lang", help="target language code (default: from the file suffix)")
    for split in ("dev", "test"):
        g.add_argument(f"--{split}-src", help=f"{split} source (default: a seeded random split of --src)")
        g.add_argument(f"--{split}-tgt", help=f"{split} target")
    c = p.add_argument_group("cleaning (train split only) and vocabulary")
    c.add_argument("--max-words", type=positive_int, default=200, help="drop pairs with a side longer than this")
    c.add_argument("--min-ratio", type=nonneg_float, default=0.3, help="lowest source/target word ratio kept")
    c.add_argument("--max-ratio", type=positive_float, default=2.0, help="highest source/target word ratio kept")
    c.add_argument("--vocab-size", type=int_range(1, MAX_VOCAB), default=8000,
                   help="joint SentencePiece vocabulary size")
    c.add_argument("--seed", type=nonneg_int, default=1, help="seed for the random dev/test split and SentencePiece")
    p.add_argument("--data-dir", help="cache root (default: $KIT_DATA_DIR, else data/ in the repo)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the prepared dir")
    a = ap.parse_args(argv)
    try:
        prep = prepare(a.corpus, src=a.src, tgt=a.tgt, src_lang=a.src_lang, tgt_lang=a.tgt_lang,
                       dev_src=a.dev_src, dev_tgt=a.dev_tgt, test_src=a.test_src, test_tgt=a.test_tgt,
                       vocab_size=a.vocab_size, max_words=a.max_words, min_ratio=a.min_ratio,
                       max_ratio=a.max_ratio, seed=a.seed, data_dir=a.data_dir, verbose=not a.quiet)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(prep.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
