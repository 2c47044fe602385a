import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORDS_EN = "the a man woman house dog cat sees has big small red green old new city king word".split()
WORDS_ES = "el un hombre mujer casa perro gato ve tiene grande pequeño rojo verde viejo nuevo ciudad rey palabra".split()


def toy_parallel(n: int, seed: int = 0):
    """A word-for-word toy language pair: learnable in a few dozen steps."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        idx = [rng.randrange(len(WORDS_EN)) for _ in range(rng.randint(3, 9))]
        src.append(" ".join(WORDS_EN[i] for i in idx))
        tgt.append(" ".join(WORDS_ES[i] for i in idx))
    return src, tgt


@pytest.fixture(scope="session")
def toy_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    src, tgt = toy_parallel(600)
    (d / "train.en").write_text("\n".join(src) + "\n", encoding="utf-8")
    (d / "train.es").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def tiny_spm(tmp_path_factory):
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("spm")
    src, tgt = toy_parallel(300)
    (d / "text.txt").write_text("\n".join(src + tgt) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(d / "text.txt"), model_prefix=str(d / "spm"), vocab_size=64,
                                   bos_id=0, pad_id=1, eos_id=2, unk_id=3, byte_fallback=False,
                                   minloglevel=2, num_threads=1)
    return str(d / "spm.model")


_PYTHON_M_EACH = """
import contextlib, io, json, runpy, sys, traceback, warnings
# an artefact of one interpreter for many commands (a module imported by an earlier one), not of theirs
warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
out = []
for argv in json.loads(sys.argv[1]):
    sys.argv, buf, err, code = list(argv), io.StringIO(), io.StringIO(), "no exit"
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
        except Exception:  # what `python -m` would show: the traceback, for this command alone
            code = "traceback"
            traceback.print_exc()
    out.append([code, buf.getvalue(), err.getvalue()])
print(json.dumps(out))
"""


def python_m_each(argvs: list[list[str]], env: dict, cwd: str = ROOT, python: str = sys.executable) -> list:
    """[[exit code, stdout, stderr]] of `python -m <argv[0]> <argv[1:]...>` for each argv, as
    `python -m` runs it, all in one interpreter: torch imports once, not once a command (about 3 s
    each on a slow core). For options that print and exit (--help, --version, a usage error); a
    command that returns without exiting gives the code "no exit", one that raises "traceback"."""
    r = subprocess.run([python, "-c", _PYTHON_M_EACH, json.dumps(argvs)], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])
