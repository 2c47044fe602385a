"""Lexical shortlist (vocabulary selection for the output layer), built from the training corpus.

    from student.shortlist import add_to_model_dir
    add_to_model_dir("runs/x/student-model", "corpus/train.src", "corpus/train.tgt", k=100, n_frequent=100)

The file format and its validation belong to the model-dir contract
(decoder/modeldir.py: read_shortlist, write_shortlist); the decoder uses it
with `Translator(..., shortlist=True)` / `python -m decoder --shortlist`.
CLI: python -m student.shortlist --help.
"""
from student.shortlist.build import Lexicon, add_to_model_dir, build, encode_corpus

__all__ = ["Lexicon", "add_to_model_dir", "build", "encode_corpus"]
