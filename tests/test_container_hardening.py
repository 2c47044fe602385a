"""The container refuses what `python -m decoder` refuses (same loader, decoder/modeldir.py):
a model dir it does not implement is one `error:` line, exit 2, no output; /run.sh refuses an
argument it would ignore. Built and run for real (docker SDK), as tests/test_container.py."""
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from test_container import image, model_dir, run  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.slow


def damaged(model_dir, tmp_path, how):
    bad = tmp_path / "model"
    shutil.copytree(model_dir, bad)
    if how == "int64 weights":
        w = load_file(str(bad / "model.safetensors"))
        w["shared.weight"] = w["shared.weight"].long()
        save_file(w, str(bad / "model.safetensors"))
        return bad, "model.safetensors: tensor shared.weight is int64"
    if how == "unreadable config":
        os.chmod(bad / "config.json", 0)  # the container runs non-root: really unreadable there
        return bad, "config.json: unreadable (Permission denied)"
    c = json.loads((bad / "config.json").read_text())
    if how == "n_heads 0":
        c["architecture"]["n_heads"] = 0
        expected = "config.json: architecture.n_heads must be in [1, 1,024], got 0"
    else:
        c["special_ids"]["eos"] = c["architecture"]["vocab_size"] + 7
        expected = "config.json: special_ids.eos must be below vocab_size"
    (bad / "config.json").write_text(json.dumps(c))
    return bad, expected


@pytest.mark.parametrize("how", ["int64 weights", "n_heads 0", "eos out of vocabulary", "unreadable config"])
def test_container_refuses_a_model_dir_it_does_not_implement(image, model_dir, tmp_path, how):  # noqa: F811
    bad, expected = damaged(model_dir, tmp_path, how)
    os.chmod(bad, 0o755)
    for f in bad.iterdir():
        if f.name != "config.json" or how != "unreadable config":
            os.chmod(f, 0o644)
    r = run(image, ["/run.sh", "CPU-1", "throughput"], b"hello\nworld\n",
            volumes={str(bad): {"bind": "/model", "mode": "ro"}})
    err = r.stderr.decode().splitlines()
    assert r.exit_code == 2 and r.stdout == b""
    assert len(err) == 1 and err[0].startswith("error:") and expected in err[0], err


def test_run_sh_extra_argument_is_a_usage_error_in_the_container(image):  # noqa: F811
    r = run(image, ["/run.sh", "CPU-1", "throughput", "extra"], b"x\n")
    assert r.exit_code == 2 and r.stdout == b"" and r.stderr.decode().startswith("usage: /run.sh")
