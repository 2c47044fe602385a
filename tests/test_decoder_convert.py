"""Converted engines (CTranslate2, HF M2M100) give our greedy fp32 tokens.

The CT2 dir appends </s> itself (add_source_eos), so sources go in without it."""
import pytest
import torch

from decoder import Translator
from tools.convert import max_decoding_length, to_ctranslate2, to_hf
from fixture_model import make_model_dir, synthetic_corpus


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request, tmp_path_factory):
    torch.set_num_threads(1)
    d = make_model_dir(tmp_path_factory.mktemp("conv") / "model", seed=4, tie_embeddings=request.param)
    tr = Translator(d, precision="fp32")
    srcs = tr.text.encode(synthetic_corpus(16, seed=11))
    # the cap: we emit at most limit-1 tokens, then </s>
    caps = [c - 1 for c in tr.limits([len(s) for s in srcs]).tolist()]
    assert caps == [max_decoding_length(len(s) - 1, tr.cfg.arch.max_positions) for s in srcs]
    return d, tr, srcs, tr.translate_ids(srcs), caps


def test_ctranslate2_greedy_gives_our_tokens(setup, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    d, tr, srcs, ours, caps = setup
    ct = ctranslate2.Translator(to_ctranslate2(d, str(tmp_path / "ct2")), device="cpu", intra_threads=1)
    piece = tr.text.sp.id_to_piece
    for s, o, cap in zip(srcs, ours, caps):
        hyp = ct.translate_batch([[piece(i) for i in s[:-1]]], beam_size=1, max_decoding_length=cap,
                                 min_decoding_length=0)[0].hypotheses[0]
        assert hyp == [piece(i) for i in o]


def test_ctranslate2_batch_with_padding_gives_our_tokens(setup, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    d, tr, srcs, ours, caps = setup
    ct = ctranslate2.Translator(to_ctranslate2(d, str(tmp_path / "ct2")), device="cpu", intra_threads=1)
    piece = tr.text.sp.id_to_piece
    ended = [i for i, (o, c) in enumerate(zip(ours, caps)) if len(o) < c]  # not cut by our cap
    res = ct.translate_batch([[piece(t) for t in srcs[i][:-1]] for i in ended], beam_size=1, max_decoding_length=1024,
                             min_decoding_length=0)
    assert [r.hypotheses[0] for r in res] == [[piece(t) for t in ours[i]] for i in ended]


def test_hf_m2m100_greedy_gives_our_tokens(setup):
    pytest.importorskip("transformers")
    d, tr, srcs, ours, caps = setup
    model, cfg = to_hf(d)
    for s, o, cap in zip(srcs, ours, caps):
        with torch.no_grad():
            g = model.generate(torch.tensor([s]), num_beams=1, do_sample=False, max_new_tokens=cap,
                               min_length=0, decoder_start_token_id=cfg.decoder_start_id,
                               eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id)[0, 1:].tolist()
        assert (g[:g.index(cfg.eos_id)] if cfg.eos_id in g else g) == o


def test_hf_m2m100_logits_match_training_model(setup):
    pytest.importorskip("transformers")
    from student.modeldir import load_model_dir
    d, _, srcs, _, _ = setup
    model, _ = to_hf(d)
    ref, _ = load_model_dir(d)
    src = torch.tensor([srcs[0]])
    tgt = torch.tensor([[2, 5, 9, 14, 20]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=src, decoder_input_ids=tgt).logits, ref(src, tgt), atol=1e-4)
