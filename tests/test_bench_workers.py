"""tools/bench_workers.py: every arrangement of two cores decodes the same batches to the same tokens."""
import os

import pytest

from tools import bench_workers
from tools.bench import read

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "bible-tiny")
MODEL = os.path.join(FIXTURE, "model")


@pytest.fixture(scope="module")
def lines():
    return read(os.path.join(FIXTURE, "test.en"))[:16]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two arrangements pin two cores")
def test_every_arrangement_gives_the_one_thread_tokens(lines):
    rates = bench_workers.measure(MODEL, lines, dict(precision="int8", shortlist=False), passes=1)
    assert list(rates) == ["1 process, 1 thread", "1 process, 2 intra-op threads",
                           "1 process, 2 threads sharing the model", "2 spawned workers",
                           "2 forked processes, one model", "2 forked processes, a model each"]
    assert all(r > 0 for r in rates.values())


def test_an_arrangement_with_other_tokens_is_refused(lines, monkeypatch):
    real = bench_workers.arrangements

    def one_wrong(model, kw, batches):
        runs, workers = real(model, kw, batches)
        runs = {k: runs[k] for k in ("1 process, 1 thread", "1 process, 2 intra-op threads")}
        right = runs["1 process, 2 intra-op threads"]
        runs["1 process, 2 intra-op threads"] = lambda: ([o[:-1] for o in right()[0]], 1.0)
        return runs, workers
    monkeypatch.setattr(bench_workers, "arrangements", one_wrong)
    with pytest.raises(SystemExit, match="1 process, 2 intra-op threads gave other tokens"):
        bench_workers.measure(MODEL, lines, dict(precision="int8", shortlist=False), passes=1)
