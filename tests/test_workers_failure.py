"""CPU-ALL worker processes that die mid-run (the OOM killer's SIGKILL): the
parent finishes the input with fewer workers, then in its own process, with
one warning per death, no line lost and the output of a one-thread run."""
import ast
import os
import signal
import time
from functools import partial

import pytest
import torch

from conftest import ROOT
from decoder import Translator
from decoder.workers import WorkerPool
from fixture_model import make_model_dir, synthetic_corpus

OPTS = dict(chunk_lines=10, max_sentences=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model_dir(tmp_path_factory.mktemp("fixture") / "model", seed=1, enc=1, dec=1)


@pytest.fixture(scope="module")
def lines():
    return synthetic_corpus(100, seed=11)


@pytest.fixture(scope="module")
def want(model_dir, lines):
    return Translator(model_dir, precision="fp32", threads=1, **OPTS).translate(lines)


def killing(lines, pool, at):
    """The lines, SIGKILLing one worker of `pool` when the reader reaches each index in `at`:
    the kill lands while the pool still has lines to translate."""
    for i, line in enumerate(lines):
        if i in at:
            os.kill(pool.pids()[0], signal.SIGKILL)
        yield line


def test_killed_worker_mid_run_loses_no_line_and_warns_once(model_dir, lines, want, capfd):
    with Translator(model_dir, precision="fp32", workers=2, **OPTS) as tr:
        capfd.readouterr()
        assert tr.translate(killing(lines, tr.pool, at={40})) == want
        assert tr.pool.n == 1 and len(tr.pool.pids()) == 1
    err = capfd.readouterr().err
    assert err.count("warning:") == 1 and "finishing the input with 1 worker process" in err, err
    assert "Traceback" not in err


def test_worker_killed_before_the_workers_encode_a_chunk_loses_no_line(model_dir, lines, want, capfd):
    """A chunk of SPLIT_ENCODE_LINES lines or more is tokenised in the workers: their
    `ids` jobs are resubmitted like batches."""
    assert len(lines) >= Translator.SPLIT_ENCODE_LINES
    with Translator(model_dir, precision="fp32", workers=2, **{**OPTS, "chunk_lines": len(lines)}) as tr:
        capfd.readouterr()
        assert tr.translate(killing(lines, tr.pool, at={40})) == want
        assert tr.pool.n == 1
    err = capfd.readouterr().err
    assert err.count("warning:") == 1 and "Traceback" not in err, err


def test_last_worker_killed_parent_finishes_in_process(model_dir, lines, want, capfd):
    with Translator(model_dir, precision="fp32", workers=2, **OPTS) as tr:
        capfd.readouterr()
        assert tr.translate(killing(lines, tr.pool, at={30, 70})) == want
        assert tr.pool.n == 0 and tr.pool.pids() == []
        assert tr.translate(lines[:7]) == want[:7]  # the parent keeps serving
    err = capfd.readouterr().err
    assert err.count("warning:") == 2 and "finishing the input with this process" in err, err


def test_batches_queued_on_a_killed_worker_are_resubmitted(model_dir, lines, want):
    one = Translator(model_dir, precision="fp32", threads=1)
    batches = [one.text.encode(lines[i:i + 5]) for i in range(0, len(lines), 5)]
    pool = WorkerPool(partial(Translator, model_dir, precision="fp32", threads=1), 2)
    try:
        assert [pool.submit(b).result() for b in batches[:1]] == [one.translate_ids(batches[0])]
        jobs = [pool.submit(b) for b in batches]  # all queued before any comes back
        os.kill(pool.pids()[1], signal.SIGKILL)
        assert [j.result() for j in jobs] == [one.translate_ids(b) for b in batches]
        assert pool.n == 1
    finally:
        pool.close()


def test_workers_module_does_not_import_the_translator():
    tree = ast.parse(open(os.path.join(ROOT, "decoder", "workers.py")).read())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in imported if "translator" in m], imported


def test_workers_are_the_oom_killers_first_choice(model_dir):
    if not os.path.exists("/proc/self/oom_score_adj"):
        pytest.skip("no /proc/self/oom_score_adj")
    pool = WorkerPool(partial(Translator, model_dir, precision="fp32", threads=1), 2)
    try:
        scores = lambda: [int(open(f"/proc/{p}/oom_score_adj").read()) for p in pool.pids()]  # noqa: E731
        deadline = time.time() + 120  # each worker sets it when it starts
        while scores() != [500, 500] and time.time() < deadline:
            time.sleep(0.1)
        assert scores() == [500, 500] and int(open("/proc/self/oom_score_adj").read()) < 500
    finally:
        pool.close()


POOL_PROGRAM = f"""import sys
sys.path.insert(0, {ROOT!r})
from functools import partial
from decoder.workers import WorkerPool
if __name__ == "__main__":
    pool = WorkerPool(partial(str, "abcb"), 2)
    print(pool.submit("b", "count").result(), pool.n)
    pool.close()
"""


@pytest.mark.parametrize("how", ["stdin", "file", "-c"])
def test_a_program_read_from_stdin_translates_in_process_with_one_clear_warning(how, tmp_path):
    # spawn re-runs the main program in each worker; from stdin there is none to run, and every
    # worker died at start, each death warned as "out of memory?" with a child's traceback
    import subprocess
    import sys
    script = tmp_path / "pool.py"
    script.write_text(POOL_PROGRAM)
    args = {"stdin": ["-"], "file": [str(script)], "-c": ["-c", POOL_PROGRAM]}[how]
    r = subprocess.run([sys.executable, *args], input=POOL_PROGRAM if how == "stdin" else "", capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    if how == "stdin":
        assert (r.stdout, r.stderr) == ("2 0\n", "warning: translation worker processes cannot start (the main "
                                        "program, <stdin>, is not a file a spawned process can run); translating "
                                        "in this process\n")
    else:
        assert (r.stdout, r.stderr) == ("2 2\n", "")
