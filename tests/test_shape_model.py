"""student.shape_model: a preset's shape with random weights and another model dir's tokenizer,
for timing a shape the kit has not trained (docs/bench/README.md)."""
import filecmp
import os

import torch

from decoder import modeldir
from decoder.translator import Translator
from fixture_model import make_model_dir, synthetic_corpus
from student.model import preset
from student.shape_model import main, shape_model


def test_a_shape_model_has_the_presets_shape_and_the_tokenizer_and_shortlist_it_is_like(tmp_path):
    like = make_model_dir(tmp_path / "like", tie_embeddings=True)
    V = modeldir.read_config(like).arch.vocab_size
    modeldir.write_shortlist(like, torch.arange(V + 1) * 2, torch.arange(2 * V) % V, torch.arange(4, 8))
    out = shape_model("student-tiny", like, str(tmp_path / "shape"), seed=3)
    a, p = modeldir.read_config(out).arch, preset("student-tiny")
    dims = ("d_model", "n_heads", "ffn_dim", "encoder_layers", "decoder_layers")
    assert [getattr(a, f) for f in dims] == [getattr(p, f) for f in dims] and a.vocab_size == V
    for f in (modeldir.SPM, modeldir.SHORTLIST):
        assert filecmp.cmp(os.path.join(like, f), os.path.join(out, f), shallow=False)


def test_a_shape_models_sentences_do_not_all_end_at_once(tmp_path):
    # a plain random initialisation (and the test models' </s> factor at this width) ends every
    # sentence at its first step: a benchmark of it would time the encoder alone
    like = make_model_dir(tmp_path / "like", tie_embeddings=True)
    out = Translator(shape_model("student-tiny", like, str(tmp_path / "shape")), precision="fp32", threads=1).translate(
        synthetic_corpus(12, seed=5))
    assert sum(1 for o in out if o) >= 9, out


def test_a_missing_model_dir_is_one_error_line(tmp_path, capsys):
    assert main(["--preset", "student-tiny", "--like", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and not (tmp_path / "o").exists()
