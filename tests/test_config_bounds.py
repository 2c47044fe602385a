"""config.json is read with a byte bound, every way it can fail to parse is one error line
naming the file, and every size in it has an upper bound that a real model stays under
(decoder/modeldir.py "resource bounds", docs/reliability.md "Bounds on inputs and options").
Before: a link to /dev/zero read forever, deep nesting raised RecursionError, a 5,000-digit
integer gave an error without the file's name, and max_positions 1e9 asked for a 512 GB
position table (a traceback) and a 256 GB per-line read cap."""
import json
import os
import shutil

import pytest
import torch

from decoder import modeldir
from decoder.modeldir import ModelDirError
from decoder.textio import line_cap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")


@pytest.fixture
def model_copy(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    return d


def one_line_naming(e: ModelDirError, path) -> str:
    text = str(e)
    assert "\n" not in text and str(path) in text, text
    assert len(text) < 300, text  # a 5,000-digit value is not repeated in full
    return text


def refused(model_dir) -> str:
    with pytest.raises(ModelDirError) as e:
        modeldir.read_config(str(model_dir))
    return one_line_naming(e.value, model_dir / "config.json")


def test_config_linked_to_dev_zero_is_refused_without_reading_it(model_copy):
    (model_copy / "config.json").unlink()
    os.symlink("/dev/zero", model_copy / "config.json")
    assert "not a regular file" in refused(model_copy)


def test_config_that_is_a_fifo_is_refused_without_blocking(model_copy):
    (model_copy / "config.json").unlink()
    os.mkfifo(model_copy / "config.json")  # opening it would wait for a writer forever
    assert "not a regular file" in refused(model_copy)


def test_config_larger_than_the_byte_bound_is_refused(model_copy):
    c = json.loads((model_copy / "config.json").read_text())
    c["provenance"]["padding"] = "x" * modeldir.MAX_CONFIG_BYTES
    (model_copy / "config.json").write_text(json.dumps(c))
    assert f"larger than {modeldir.MAX_CONFIG_BYTES:,} bytes" in refused(model_copy)


@pytest.mark.parametrize("body,why", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # RecursionError before
    (b'{"format_version": ' + b"9" * 5000 + b"}", "not valid JSON"),  # int() digit limit: ValueError
    (b'{"format_version": 1, "x": "\xff\xfe"}', "not UTF-8"),
    (b'{"format_version": 1,', "not valid JSON"),
    (b"", "not valid JSON"),
], ids=["deep nesting", "5000-digit integer", "bad UTF-8", "truncated", "empty"])
def test_every_parse_failure_is_one_line_naming_the_file(model_copy, body, why):
    (model_copy / "config.json").write_bytes(body)
    assert why in refused(model_copy)


def test_a_4000_digit_size_is_refused_by_the_schema_in_a_short_line(model_copy):
    c = json.loads((model_copy / "config.json").read_text())
    c["architecture"]["vocab_size"] = int("9" * 4000)  # under Python's 4,300-digit limit: it parses
    (model_copy / "config.json").write_text(json.dumps(c))
    assert "architecture.vocab_size must be in [1, 1,048,576]" in refused(model_copy)


BOUNDS = {"vocab_size": modeldir.MAX_VOCAB, "d_model": modeldir.MAX_D_MODEL, "n_heads": modeldir.MAX_HEADS,
          "ffn_dim": modeldir.MAX_FFN_DIM, "encoder_layers": modeldir.MAX_LAYERS,
          "decoder_layers": modeldir.MAX_LAYERS, "max_positions": modeldir.MAX_POSITIONS}


@pytest.mark.parametrize("key", sorted(BOUNDS))
def test_every_size_has_an_upper_bound_and_the_bound_itself_is_accepted(key):
    c = json.loads(open(os.path.join(FIXTURE, "config.json")).read())
    a = c["architecture"]
    a[key] = BOUNDS[key]
    if key == "n_heads":
        a["d_model"] = BOUNDS[key]  # n_heads must divide d_model
    modeldir.check_config(c)  # the bound: a size a real model could have
    a[key] = BOUNDS[key] + 1
    with pytest.raises(ModelDirError, match=f"architecture.{key} must be in"):
        modeldir.check_config(c)


def test_bounds_are_what_real_models_have():
    # generous for the largest public models (NLLB/Gemma 256k vocabularies, d_model 16,384,
    # 126 layers), and the per-line read cap they give stays at 16 MiB
    assert modeldir.MAX_VOCAB >= 262_144 and modeldir.MAX_D_MODEL >= 16_384 and modeldir.MAX_LAYERS >= 128
    assert modeldir.MAX_POSITIONS == 65_536 and line_cap(modeldir.MAX_POSITIONS) == 16 << 20


def test_max_positions_1e9_is_one_error_line_before_any_allocation(model_copy, tmp_path, capsys):
    from decoder.__main__ import main
    c = json.loads((model_copy / "config.json").read_text())
    c["architecture"]["max_positions"] = 10**9
    (model_copy / "config.json").write_text(json.dumps(c))
    (tmp_path / "in.txt").write_text("hello\n")
    assert main(["--model", str(model_copy), "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --model {model_copy / 'config.json'}: architecture.max_positions must be in [2, 65,536], "
                   f"got 1000000000"]


def test_a_model_that_cannot_be_allocated_is_one_error_line(tmp_path, capsys, monkeypatch):
    # the position table asks the allocator for more than any machine has: torch's own
    # error (DefaultCPUAllocator: can't allocate memory), raised where the model is built
    from decoder import model as model_module
    from decoder.__main__ import main

    def table_too_big(n, dim, pad_id):
        return torch.empty(1 << 62, dtype=torch.uint8)
    monkeypatch.setattr(model_module, "sinusoidal_table", table_too_big)
    (tmp_path / "in.txt").write_text("hello\n")
    assert main(["--model", FIXTURE, "-q", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --model {FIXTURE}: not enough memory to load the model ("), err
    assert not (tmp_path / "out.txt").exists()


def test_weights_that_cannot_be_allocated_are_one_error_line_naming_the_file(monkeypatch):
    import safetensors.torch

    def load_too_big(path, device="cpu"):
        return {"x": torch.empty(1 << 62, dtype=torch.uint8)}
    monkeypatch.setattr(safetensors.torch, "load_file", load_too_big)
    with pytest.raises(ModelDirError) as e:
        modeldir.load(FIXTURE)
    where = os.path.join(FIXTURE, "model.safetensors")
    assert "not enough memory to load the weights" in one_line_naming(e.value, where)



@pytest.mark.parametrize("name", ["model.safetensors", "spm.model"])
def test_weights_or_vocabulary_linked_to_dev_zero_are_refused_without_reading_them(model_copy, name):
    (model_copy / name).unlink()
    os.symlink("/dev/zero", model_copy / name)
    with pytest.raises(ModelDirError) as e:
        modeldir.load(str(model_copy))
    assert "not a regular file" in one_line_naming(e.value, model_copy / name)


def test_a_sentencepiece_file_over_its_bound_is_refused_before_it_is_read(model_copy, monkeypatch):
    monkeypatch.setattr(modeldir, "MAX_SPM_BYTES", 1000)  # the fixture's is about 250 KB
    with pytest.raises(ModelDirError) as e:
        modeldir.load(str(model_copy))
    assert "larger than 1,000 bytes" in one_line_naming(e.value, model_copy / "spm.model")
