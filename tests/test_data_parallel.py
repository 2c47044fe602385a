"""student.data over several processes: the same prepared dir as one process, cores counted
as the container's CPU-ALL counts them, and the undecoded emptiness check of the routing."""
import os
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from student.data import parallel, pipeline, prepare
from student.data.corpus import decode_line, has_text


def messy_corpus(d, n=1500, seed=0):
    """Pairs that every cleaning rule, the duplicate filter, invalid UTF-8, Unicode spaces
    and the Moses rules' characters touch, across many chunks."""
    rng = random.Random(seed)
    words = "the a casa «perro» “dog” x\u00a0y über 1,5 ( ) ! ? – … : ;".split()
    src, tgt = [], []
    for i in range(n):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12))).encode()
        t = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12))).encode()
        kind = rng.randrange(12)
        if kind == 0 and src:  # an exact duplicate of an earlier pair
            j = rng.randrange(len(src))
            s, t = src[j], tgt[j]
        elif kind == 1:
            s = rng.choice([b"", b"  ", "\u3000\u00a0".encode(), b"\x1c"])
        elif kind == 2:
            s += b"\xff\xfe"  # invalid UTF-8
        elif kind == 3:
            t += b"\x07"
        elif kind == 4:
            s = b" ".join([s] * 30)
        src.append(s)
        tgt.append(t)
    paths = []
    for name, lines in (("c.en", src), ("c.es", tgt)):
        paths.append(os.path.join(d, name))
        with open(paths[-1], "wb") as fh:
            fh.write(b"\n".join(lines) + b"\n")
    return paths


def prepared_files(prep) -> dict:
    """Every file of a prepared dir but spm.model, whose trainer spec names its temp input path
    (spm.vocab holds what it learned: every piece and its score)."""
    out = {}
    for name in sorted(os.listdir(prep.dir)):
        if name != "spm.model":
            with open(os.path.join(prep.dir, name), "rb") as fh:
                out[name] = fh.read()
    return out


def test_prepare_over_two_processes_writes_the_bytes_of_one(tmp_path, monkeypatch):
    src, tgt = messy_corpus(str(tmp_path))
    # small chunks and no size floor, so both stages go through a pool and cross many tasks
    monkeypatch.setattr(pipeline, "CHUNK", 97)
    monkeypatch.setattr(pipeline, "NORM_CHUNK", 61)
    monkeypatch.setattr(pipeline, "POOL_BYTES", 0)
    runs = {}
    for n in (1, 2):
        monkeypatch.setattr(pipeline, "workers", lambda n=n: n)
        runs[n] = prepare(src=src, tgt=tgt, data_dir=str(tmp_path / f"data{n}"), vocab_size=300, verbose=False)
    one, two = (prepared_files(runs[n]) for n in (1, 2))
    assert set(one) == {"prepared.json", "spm.vocab", *(f"{k}.{x}" for k in ("train", "dev", "test") for x in ("en", "es"))}
    assert one == two
    c = runs[1].counts
    assert c["invalid_utf8_lines"] > 50 and all(c["removed"].values()), c  # every rule fired


def test_workers_are_the_affinity_capped_by_the_cgroup_quota_and_shared_by_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel.cgroup, "ROOT", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert parallel.workers() == cores  # no cgroup files: the affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert parallel.workers() == min(cores, 2)  # 1.5 CPUs keep 2 cores busy
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert parallel.workers() == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))
    assert parallel.workers() == 1


SPACES = ["", " ", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\u00a0", "\u2028", "\u3000", "\u200b"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(SPACES), st.sampled_from(["a", "é", "«", "\ufffd", "\x00"]),
                          st.binary(max_size=3).map(lambda b: b.decode("latin-1"))), max_size=6),
       st.binary(max_size=3))
def test_has_text_says_whether_the_decoded_stripped_line_is_empty(parts, tail):
    raw = "".join(parts).encode("utf-8") + tail  # the tail: invalid UTF-8 as often as not
    assert has_text(raw) == bool(decode_line(raw)[0])
