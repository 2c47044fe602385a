"""Converted dirs used the plain way a CTranslate2 / transformers user would, on the trained
fixture: the code in each dir's README.md, run as written, gives `python -m decoder`'s lines."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")
TEST_EN = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "test.en")
N_LINES = 40
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _cli(*args, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def lines():
    with open(TEST_EN, encoding="utf-8") as fh:
        return fh.read().splitlines()[:N_LINES]


@pytest.fixture(scope="module")
def ours(lines):
    """The decoder CLI's output (fp32: the converted weights are fp32)."""
    r = _cli("-m", "decoder", "--model", MODEL, "--precision", "fp32", "--threads", "1",
             input="\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert len(out) == len(lines)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    for engine in ("ct2", "hf"):
        r = _cli("-m", "tools.convert", "--to", engine, MODEL, str(d / engine))
        assert r.returncode == 0, r.stderr
    return d


def _readme_code(d) -> str:
    text = (d / "README.md").read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_ct2_readme_call_gives_decoder_output(converted, lines, ours):
    pytest.importorskip("ctranslate2")
    cfg = (converted / "ct2" / "config.json").read_text()
    assert '"add_source_eos": true' in cfg  # the user passes SentencePiece pieces only
    env = {"lines": lines}
    exec(_readme_code(converted / "ct2"), env)  # the documented call, as written
    assert env["hyps"] == ours


def test_ct2_one_batch_call_gives_decoder_output_below_the_cap(converted, lines, ours):
    """One translate_batch for all lines shares the largest cap: lines that end
    before their own cap are ours exactly."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    import sacremoses
    import sentencepiece
    from tools.convert import max_decoding_length
    sp = sentencepiece.SentencePieceProcessor(model_file=str(converted / "ct2" / "spm.model"))
    norm = sacremoses.MosesPunctNormalizer(lang="en", penn=True, norm_quote_commas=True, norm_numbers=True,
                                           pre_replace_unicode_punct=True, post_remove_control_chars=True)
    tokens = [sp.encode(norm.normalize(s), out_type=str) for s in lines]
    caps = [max_decoding_length(len(t), 1024) for t in tokens]
    tr = ctranslate2.Translator(str(converted / "ct2"), device="cpu", intra_threads=1)
    res = tr.translate_batch(tokens, beam_size=1, max_decoding_length=max(caps), min_decoding_length=0)
    below = [i for i, r in enumerate(res) if len(r.hypotheses[0]) < caps[i]]
    assert len(below) >= N_LINES - 3
    assert [sp.decode(res[i].hypotheses[0]) for i in below] == [ours[i] for i in below]


def test_hf_readme_generate_gives_decoder_output(converted, lines, ours):
    """AutoTokenizer + AutoModelForSeq2SeqLM + plain generate() on the directory; HF has no
    per-line cap, so a line our decoder cut at its cap is checked with max_new_tokens = that cap."""
    pytest.importorskip("transformers")
    import torch
    torch.set_num_threads(1)
    env = {"lines": lines}
    exec(_readme_code(converted / "hf"), env)
    tok, model, hyps = env["tok"], env["model"], env["hyps"]
    from tools.convert import max_decoding_length
    n_src = [len(ids) - 1 for ids in tok([env["normalise"](s) for s in lines])["input_ids"]]
    caps = [max_decoding_length(n, 1024) for n in n_src]
    eos = model.generation_config.eos_token_id
    gen = [row[1:row.index(eos, 1)] if eos in row[1:] else row[1:] for row in env["out"].tolist()]
    capped = [i for i in range(len(lines)) if len(gen[i]) >= caps[i]]  # HF ran past our cap
    assert len(capped) <= 3
    assert [h for i, h in enumerate(hyps) if i not in capped] == [o for i, o in enumerate(ours) if i not in capped]
    for i in capped:
        g = model.generate(**tok([env["normalise"](lines[i])], return_tensors="pt"), max_new_tokens=caps[i])
        assert tok.batch_decode(g, skip_special_tokens=True)[0] == ours[i]


def test_hf_tokenizer_encodes_like_the_decoder_pipeline(converted, lines):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer
    from decoder import modeldir
    from decoder.pipeline import Text
    cfg, _, spm_path = modeldir.load(MODEL)
    text = Text(cfg, spm_path, cfg.arch.max_positions)
    tok = AutoTokenizer.from_pretrained(str(converted / "hf"))
    odd = ["  leading and   inner  spaces ", "\ttab", "ünïcödé ＡＢＣ ﬁ ½", "a\u00a0b\u3000c", "漢字 and ▁marks",
           "«quotes» — dash", "x"]
    with open(TEST_EN, encoding="utf-8") as fh:
        sample = fh.read().splitlines()
    for s in sample + odd:
        assert tok(text.normalise(s))["input_ids"] == text.encode([s])[0], s


def test_hf_dir_has_generation_settings_and_safetensors(converted):
    pytest.importorskip("transformers")
    from transformers import GenerationConfig
    g = GenerationConfig.from_pretrained(str(converted / "hf"))
    assert (g.decoder_start_token_id, g.eos_token_id, g.pad_token_id, g.num_beams) == (2, 2, 1, 1)
    assert g.max_length == 1024 and not g.do_sample and g.forced_bos_token_id is None
    assert (converted / "hf" / "model.safetensors").is_file()
