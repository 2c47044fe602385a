"""python -m tools.convert: --from-hf makes a model dir the decoder reads and decodes as HF
generate() does; round trips are exact; bad input is one error line and exit 2."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import python_m_each, toy_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _cli(*args, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, **kw)


def _convert(*args):
    return _cli("-m", "tools.convert", *args)


def _tiny_hf(path, spm_path, tie: bool, seed: int):
    """A random M2M100 checkpoint as save_pretrained writes it, with our spm beside it."""
    import sentencepiece as spm
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration
    torch.manual_seed(seed)
    V = spm.SentencePieceProcessor(model_file=spm_path).get_piece_size()
    cfg = M2M100Config(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       max_position_embeddings=128, scale_embedding=True, init_std=0.3, dropout=0.0,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                       tie_word_embeddings=tie)
    model = M2M100ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # LayerNorms away from the identity, so every tensor is checked
        for n, p in model.named_parameters():
            if "layer_norm" in n:
                p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
        # transformers 5 unties the input embeddings from `shared` too when the output is untied;
        # M2M100 checkpoints (fairseq) share them, as our decoder does
        model.model.encoder.embed_tokens.weight.copy_(model.model.shared.weight)
        model.model.decoder.embed_tokens.weight.copy_(model.model.shared.weight)
    model.generation_config.forced_bos_token_id = None
    model.save_pretrained(path)
    shutil.copyfile(spm_path, os.path.join(path, "spm.model"))
    return model


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_from_hf_model_dir_decodes_as_hf_generate(tie, tiny_spm, tmp_path):
    import sentencepiece as spm
    import torch
    from decoder import modeldir
    from tools.convert import max_decoding_length
    torch.set_num_threads(1)
    model = _tiny_hf(tmp_path / "hf", tiny_spm, tie, seed=3)
    r = _convert("--from-hf", str(tmp_path / "hf"), str(tmp_path / "ours"), "--src-lang", "en", "--tgt-lang", "es")
    assert r.returncode == 0, r.stderr
    cfg, _, _ = modeldir.load(str(tmp_path / "ours"))
    assert cfg.arch.tie_embeddings == tie and cfg.normaliser == {}
    lines = toy_parallel(12, seed=5)[0]
    d = _cli("-m", "decoder", "--model", str(tmp_path / "ours"), "--precision", "fp32", "--threads", "1",
             input="\n".join(lines) + "\n")
    assert d.returncode == 0, d.stderr
    sp = spm.SentencePieceProcessor(model_file=tiny_spm)
    want = []
    for s in lines:
        ids = sp.encode(s) + [2]
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), num_beams=1, do_sample=False,
                               max_new_tokens=max_decoding_length(len(ids) - 1, 128))[0, 1:].tolist()
        want.append(sp.decode(g[:g.index(2)] if 2 in g else g))
    assert d.stdout.splitlines() == want


def test_hf_round_trip_gives_back_the_model_dir(tmp_path):
    import torch
    from decoder import modeldir
    assert _convert("--to", "hf", FIXTURE, str(tmp_path / "hf")).returncode == 0
    r = _convert("--from-hf", str(tmp_path / "hf"), str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr  # languages and normaliser come back from kit.json
    a, wa, _ = modeldir.load(FIXTURE)
    b, wb, _ = modeldir.load(str(tmp_path / "back"))
    assert (a.arch, a.normaliser, a.src_lang, a.tgt_lang, a.decoder_start_id) == \
        (b.arch, b.normaliser, b.src_lang, b.tgt_lang, b.decoder_start_id)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_help_says_what_no_value_means_and_not_default_none():
    r = _convert("--help")
    text = " ".join(r.stdout.split())  # argparse wraps at the terminal's width
    assert r.returncode == 0 and "--to {ct2,hf}" in text and "None = float32, exact" in text
    assert "(default: None)" not in text and "(default: False)" not in text


BAD_INPUT = {  # what the one error line says: the arguments
    "no such directory": ["--to", "ct2", "/nonexistent/model", "OUT"],
    "--quantization applies to --to ct2 only": ["--to", "hf", "--quantization", "int8", FIXTURE, "OUT"],
    "apply to --from-hf only": ["--to", "ct2", "--spm", "x.model", FIXTURE, "OUT"],
    "invalid choice": ["--to", "xx", FIXTURE, "OUT"],
    "not allowed with": ["--to", "ct2", "--from-hf", FIXTURE, "OUT"],
    "no model_type, so not a Hugging Face model dir (a kit model dir converts the other way: --to hf)":
        ["--from-hf", FIXTURE, "OUT"],
    "replace the input": ["--to", "ct2", FIXTURE, FIXTURE],
}


@pytest.fixture(scope="module")
def bad_input(tmp_path_factory) -> tuple:
    """(OUT's path, {case: [exit code, stdout, stderr]}), each as `python -m tools.convert` runs it."""
    out = str(tmp_path_factory.mktemp("bad") / "out")
    argvs = [["tools.convert", *(out if a == "OUT" else a for a in args)] for args in BAD_INPUT.values()]
    return out, dict(zip(BAD_INPUT, python_m_each(argvs, env=ENV)))


@pytest.mark.parametrize("says", sorted(BAD_INPUT))
def test_bad_input_is_one_error_line_and_exit_2(bad_input, says):
    out, results = bad_input
    code, stdout, stderr = results[says]
    err = stderr.strip().splitlines()
    # ours: "error: ..."; the parser's: "python -m tools.convert: error: ... (see ... --help)"
    assert code == 2 and len(err) == 1 and "error: " in err[0] and says in err[0], stderr
    assert "Traceback" not in stderr and not os.path.exists(out)


def test_existing_output_is_kept_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    r = _convert("--to", "ct2", FIXTURE, str(out))
    assert r.returncode == 2 and r.stderr.startswith("error:") and "--force" in r.stderr
    assert (out / "keep").read_text() == "x"
    assert _convert("--to", "ct2", "--force", FIXTURE, str(out)).returncode == 0
    assert (out / "config.json").is_file() and not (out / "keep").exists()


def test_from_hf_refuses_separate_input_embeddings(tiny_spm, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    _tiny_hf(tmp_path / "hf", tiny_spm, False, seed=2)
    w = load_file(tmp_path / "hf" / "model.safetensors")
    w["model.decoder.embed_tokens.weight"] = torch.randn_like(w["model.decoder.embed_tokens.weight"])
    save_file(w, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    r = _convert("--from-hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--src-lang", "en", "--tgt-lang", "es")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error:")
    assert "differs from model.shared.weight" in r.stderr and not (tmp_path / "out").exists()


def test_from_hf_refuses_a_forced_first_token(tiny_spm, tmp_path):
    from transformers import GenerationConfig
    _tiny_hf(tmp_path / "hf", tiny_spm, True, seed=1)
    GenerationConfig(decoder_start_token_id=2, forced_bos_token_id=5).save_pretrained(tmp_path / "hf")
    r = _convert("--from-hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--src-lang", "en", "--tgt-lang", "es")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "forces a first token" in r.stderr
