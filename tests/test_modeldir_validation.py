"""A model dir whose config.json or weights this decoder does not implement is refused at load
time with one `error:` line naming the file and the key or tensor (exit 2), never decoded into
silently wrong output and never a traceback after input was read."""
import builtins
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoder import modeldir
from decoder.modeldir import ModelDirError
from fixture_model import make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("valid") / "model", vocab_size=300, d_model=32,
                          enc=1, dec=1, n_heads=4, seed=3)


def copy_with(model_dir, tmp_path, config=None, tensors=None):
    """A copy of model_dir with config.json edited by config(dict) and weights by tensors(dict)."""
    d = tmp_path / "bad"
    shutil.copytree(model_dir, d)
    if config:
        c = json.loads((d / "config.json").read_text())
        config(c)
        (d / "config.json").write_text(json.dumps(c))
    if tensors:
        w = load_file(str(d / "model.safetensors"))
        tensors(w)
        save_file(w, str(d / "model.safetensors"))
    return str(d)


def setkey(section, key, value):
    def edit(c):
        (c[section] if section else c)[key] = value
    return edit


# (config edit, the key the message must name)
BAD_CONFIGS = {
    "n_heads 0": (setkey("architecture", "n_heads", 0), "architecture.n_heads"),
    "n_heads not dividing d_model": (setkey("architecture", "n_heads", 3), "architecture.n_heads"),
    "d_model a string": (setkey("architecture", "d_model", "32"), "architecture.d_model"),
    "d_model a float": (setkey("architecture", "d_model", 32.0), "architecture.d_model"),
    "max_positions a string": (setkey("architecture", "max_positions", "1024"), "architecture.max_positions"),
    "max_positions 0": (setkey("architecture", "max_positions", 0), "architecture.max_positions"),
    "layer_norm_eps a string": (setkey("architecture", "layer_norm_eps", "x"), "architecture.layer_norm_eps"),
    "layer_norm_eps negative": (setkey("architecture", "layer_norm_eps", -1e-5), "architecture.layer_norm_eps"),
    "type lstm": (setkey("architecture", "type", "lstm"), "architecture.type"),
    "positions learned": (setkey("architecture", "positions", "learned"), "architecture.positions"),
    "scale_embedding false": (setkey("architecture", "scale_embedding", False), "architecture.scale_embedding"),
    "tie_embeddings 'no'": (setkey("architecture", "tie_embeddings", "no"), "architecture.tie_embeddings"),
    "activation swish": (setkey("architecture", "activation", "swish"), "architecture.activation"),
    "encoder_layers -1": (setkey("architecture", "encoder_layers", -1), "architecture.encoder_layers"),
    "vocab_size true": (setkey("architecture", "vocab_size", True), "architecture.vocab_size"),
    "unknown architecture key": (setkey("architecture", "layernorm_embedding", True),
                                 "architecture.layernorm_embedding"),
    "decoder_start -5": (setkey("special_ids", "decoder_start", -5), "special_ids.decoder_start"),
    "eos out of vocabulary": (setkey("special_ids", "eos", 5000), "special_ids.eos"),
    "pad out of vocabulary": (lambda c: c["special_ids"].update(pad=c["architecture"]["vocab_size"]),
                              "special_ids.pad"),
    "pad a string": (setkey("special_ids", "pad", "1"), "special_ids.pad"),
    "normaliser 'moses'": (setkey(None, "normaliser", "moses"), "normaliser"),
    "normaliser type unknown": (setkey("normaliser", "type", "moses"), "normaliser.type"),
    "normaliser flag a string": (setkey("normaliser", "penn", "false"), "normaliser.penn"),
    "languages.src empty": (setkey("languages", "src", ""), "languages.src"),
    "files.weights another name": (setkey("files", "weights", "other.safetensors"), "files.weights"),
    "architecture a list": (setkey(None, "architecture", [1, 2]), "architecture"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_config_value_outside_the_schema_is_refused_naming_file_and_key(model_dir, tmp_path, case):
    edit, key = BAD_CONFIGS[case]
    d = copy_with(model_dir, tmp_path, config=edit)
    with pytest.raises(ModelDirError) as e:
        modeldir.load(d)
    msg = str(e.value)
    assert msg.startswith(os.path.join(d, "config.json") + ": ") and key in msg and "\n" not in msg


BAD_TENSORS = {
    "int64 embedding": lambda w: w.update({"shared.weight": w["shared.weight"].long()}),
    "fp16 embedding": lambda w: w.update({"shared.weight": w["shared.weight"].half()}),
    "fp64 projection": lambda w: w.update({"lm_head.weight": w["lm_head.weight"].double()}),
    "bool layer norm": lambda w: w.update({"encoder.layer_norm.weight": w["encoder.layer_norm.weight"].bool()}),
    "NaN weight": lambda w: w["decoder.layers.0.fc1.weight"].__setitem__((0, 0), float("nan")),
    "inf bias": lambda w: w["encoder.layers.0.self_attn.q_proj.bias"].__setitem__(3, float("-inf")),
}
BAD_TENSOR_NAMES = {"int64 embedding": "shared.weight", "fp16 embedding": "shared.weight",
                    "fp64 projection": "lm_head.weight", "bool layer norm": "encoder.layer_norm.weight",
                    "NaN weight": "decoder.layers.0.fc1.weight",
                    "inf bias": "encoder.layers.0.self_attn.q_proj.bias"}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_tensor_of_wrong_dtype_or_not_finite_is_refused_naming_it(model_dir, tmp_path, case):
    d = copy_with(model_dir, tmp_path, tensors=BAD_TENSORS[case])
    with pytest.raises(ModelDirError) as e:
        modeldir.load(d)
    msg = str(e.value)
    assert msg.startswith(os.path.join(d, "model.safetensors") + ": ") and BAD_TENSOR_NAMES[case] in msg


def test_what_the_exporter_writes_passes_the_schema(model_dir):
    # the fixture writes config.json with ModelConfig.to_json, as student.export does
    cfg, weights, _ = modeldir.load(model_dir)
    modeldir.check_config(cfg.to_json())
    assert set(cfg.to_json()["architecture"]) == set(modeldir.SCHEMA["architecture"])
    bible = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model", "config.json")
    modeldir.check_config(json.load(open(bible)))


def test_unreadable_config_is_one_error_not_a_traceback(model_dir, tmp_path, monkeypatch):
    d = copy_with(model_dir, tmp_path)
    cpath = os.path.join(d, "config.json")
    real_open = builtins.open

    def deny(path, *a, **kw):  # as root, chmod 000 does not stop us: simulate the refusal
        if os.fspath(path) == cpath:
            raise PermissionError(13, "Permission denied", cpath)
        return real_open(path, *a, **kw)
    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(ModelDirError, match=r"config.json: unreadable \(Permission denied\)"):
        modeldir.read_config(d)


def test_directory_named_config_json_is_one_error(model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    os.remove(d / "config.json")
    os.mkdir(d / "config.json")
    with pytest.raises(ModelDirError, match="config.json: "):
        modeldir.read_config(str(d))


def run_cli(model, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "decoder", "--model", str(model), "--threads", "1", *args],
                          input=b"the dog\na cat\n", capture_output=True, env=env, cwd=ROOT, timeout=300)


# the cases that gave empty lines with exit 0, or a traceback, in `python -m decoder`
CLI_CASES = {
    "int64 embedding": (None, BAD_TENSORS["int64 embedding"], "model.safetensors: tensor shared.weight"),
    "NaN weight": (None, BAD_TENSORS["NaN weight"], "model.safetensors: tensor decoder.layers.0.fc1.weight"),
    "n_heads 0": (BAD_CONFIGS["n_heads 0"][0], None, "config.json: architecture.n_heads"),
    "eos out of vocabulary": (BAD_CONFIGS["eos out of vocabulary"][0], None, "config.json: special_ids.eos"),
    "positions learned": (BAD_CONFIGS["positions learned"][0], None, "config.json: architecture.positions"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_refuses_bad_model_dir_with_one_error_line(model_dir, tmp_path, case):
    config, tensors, expected = CLI_CASES[case]
    r = run_cli(copy_with(model_dir, tmp_path, config=config, tensors=tensors))
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and r.stdout == b"", r.stderr.decode()[-2000:]
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_finiteness_check_tells_overflowing_sums_from_non_finite_values():
    # the check sums each tensor first: huge finite weights overflow that sum, yet are finite
    modeldir.check_weights({"huge": torch.full((4,), 3e38)}, "w.safetensors")
    for bad in ([1.0, float("nan")], [float("inf"), float("-inf")], [3e38, 3e38, float("inf")]):
        with pytest.raises(ModelDirError, match="w.safetensors: tensor t holds NaN or infinite values"):
            modeldir.check_weights({"t": torch.tensor(bad)}, "w.safetensors")
