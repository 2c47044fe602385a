"""Corpus acquisition, cleaning, Moses normalisation and the joint SentencePiece vocab.

    from student.data import prepare, normalise
    p = prepare("bible-en-es")              # or prepare(src="c.en", tgt="c.de")
    src, tgt = p.read("train")              # raw text; normalise when encoding:
    normalise(src[0], p.src_lang, p.normaliser)

CLI: python -m student.data prepare --help
"""
from .clean import clean_pairs, normalise, normaliser_settings
from .corpus import DataError, read_lines
from .pipeline import Prepared, prepare, summary

__all__ = ["prepare", "Prepared", "normalise", "normaliser_settings", "clean_pairs",
           "DataError", "read_lines", "summary"]
