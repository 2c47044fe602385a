"""Model-dir export: round trip and every way a model dir can be broken."""
import json
import os
import subprocess
import sys

import pytest
import torch

from decoder.modeldir import ModelDirError, load
from student.modeldir import load_model_dir, write_model_dir
from student.model import ModelArgs, Transformer

ARGS = dict(vocab_size=64, d_model=32, n_heads=4, ffn_dim=48, encoder_layers=2, decoder_layers=1, dropout=0.0)


@pytest.fixture
def model_dir(tmp_path, tiny_spm):
    torch.manual_seed(0)
    m = Transformer(ModelArgs(**ARGS)).eval()
    meta = {"src_lang": "en", "tgt_lang": "es", "normaliser": {"type": "moses-punct", "src_lang": "en"}}
    out = write_model_dir(m, tiny_spm, str(tmp_path / "model"), meta, {"note": "test"})
    return m, out


def test_export_then_load_gives_identical_logits(model_dir):
    m, out = model_dir
    m2, cfg = load_model_dir(out)
    src = torch.tensor([[5, 9, 13, 2, 1], [7, 8, 2, 1, 1]])
    tgt = torch.tensor([[2, 4, 6, 10], [2, 11, 12, 1]])
    assert torch.equal(m(src, tgt), m2(src, tgt))
    assert cfg.src_lang == "en" and cfg.normaliser["type"] == "moses-punct"


def test_config_records_contract_fields(model_dir):
    _, out = model_dir
    c = json.load(open(os.path.join(out, "config.json")))
    assert c["format_version"] == 1
    assert c["special_ids"] == {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "decoder_start": 2}
    assert c["architecture"]["encoder_layers"] == 2 and c["provenance"] == {"note": "test"}


def test_export_leaves_no_temporary_dirs(model_dir, tmp_path):
    assert sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "spm.model"])
def test_missing_file_is_one_error_naming_it(model_dir, name):
    _, out = model_dir
    os.remove(os.path.join(out, name))
    with pytest.raises(ModelDirError, match=f"{name}: missing file"):
        load(out)


def test_unknown_format_version_is_refused(model_dir):
    _, out = model_dir
    p = os.path.join(out, "config.json")
    c = json.load(open(p))
    c["format_version"] = 99
    json.dump(c, open(p, "w"))
    with pytest.raises(ModelDirError, match=r"config.json: unknown format_version 99"):
        load(out)


def test_shape_mismatch_names_the_tensor(model_dir):
    _, out = model_dir
    p = os.path.join(out, "config.json")
    c = json.load(open(p))
    c["architecture"]["ffn_dim"] = 50
    json.dump(c, open(p, "w"))
    with pytest.raises(ModelDirError, match=r"model.safetensors: shape mismatch for encoder.layers.0.fc1.weight"):
        load(out)


def test_truncated_weights_are_reported(model_dir):
    _, out = model_dir
    p = os.path.join(out, "model.safetensors")
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])
    with pytest.raises(ModelDirError, match="model.safetensors: unreadable safetensors"):
        load(out)


def test_garbage_config_is_reported(model_dir):
    _, out = model_dir
    open(os.path.join(out, "config.json"), "wb").write(b"\xff\x00not json")
    with pytest.raises(ModelDirError, match="config.json: not UTF-8"):
        load(out)


def test_config_missing_field_is_reported(model_dir):
    _, out = model_dir
    p = os.path.join(out, "config.json")
    c = json.load(open(p))
    del c["special_ids"]
    json.dump(c, open(p, "w"))
    with pytest.raises(ModelDirError, match="config.json: missing or malformed field 'special_ids'"):
        load(out)


def test_vocab_size_disagreeing_with_spm_is_reported(model_dir, tmp_path):
    m, out = model_dir
    big = Transformer(ModelArgs(**{**ARGS, "vocab_size": 70}))
    with pytest.raises(ModelDirError, match="spm.model: vocabulary has 64 pieces"):
        write_model_dir(big, os.path.join(out, "spm.model"), str(tmp_path / "bad"), {})
    assert not os.path.exists(tmp_path / "bad")  # nothing half-written is published


def test_export_cli_missing_checkpoint_is_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "student.export", str(tmp_path / "nope.pt"), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip() == f"error: {tmp_path / 'nope.pt'}: no such checkpoint"


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_model_dir_gets_the_modes_of_the_users_umask(tmp_path, tiny_spm, umask):
    old = os.umask(umask)
    try:
        out = write_model_dir(Transformer(ModelArgs(**ARGS)), tiny_spm, str(tmp_path / "model"), {})
    finally:
        os.umask(old)
    modes = {n: os.stat(os.path.join(out, n)).st_mode & 0o7777 for n in (".", *os.listdir(out))}
    f = 0o666 & ~umask
    assert modes == {".": 0o777 & ~umask, "config.json": f, "model.safetensors": f, "spm.model": f}


def test_provenance_records_paths_relative_to_the_run_dir_and_every_override(tmp_path, tiny_spm):
    import dataclasses

    from student.export import export_checkpoint
    from student.train.trainer import TrainConfig
    work = tmp_path / "work"  # where training ran: --out runs/t, --dev-src given relative to it
    run = work / "runs" / "t"
    run.mkdir(parents=True)
    cfg = TrainConfig(out_dir="runs/t", model_overrides={"dropout": 0.2}, lr=3e-3,
                      src=str(tmp_path / "corpus" / "x.en"), tgt=str(tmp_path / "corpus" / "x.es"),
                      dev_src="dev/nt.en", dev_tgt="dev/nt.es")
    m = Transformer(ModelArgs(**ARGS))
    torch.save({"model": m.state_dict(), "model_args": dataclasses.asdict(m.args), "step": 7, "best_bleu": 1.5,
                "meta": {"spm_model": tiny_spm, "preset": "student-tiny"},
                "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list))}, run / "best.pt")
    out = export_checkpoint(str(run / "best.pt"), str(tmp_path / "model"))
    prov = json.load(open(os.path.join(out, "config.json")))["provenance"]
    assert str(tmp_path) not in json.dumps(prov)  # no host path
    assert (prov["checkpoint"], prov["step"], prov["preset"], prov["set"]) == ("best.pt", 7, "student-tiny",
                                                                              {"dropout": 0.2})
    assert prov["options"] == {"lr": 3e-3, "src": "../../../corpus/x.en", "tgt": "../../../corpus/x.es",
                               "dev_src": "../../dev/nt.en", "dev_tgt": "../../dev/nt.es"}
