"""Property tests (Hypothesis) of the invariant that matters most: whatever the bytes,
one output line per input line, in order, with no line break inside an output line,
and the same output from the in-process Translator, `--threads 1` and `--workers 2`.

Many examples go through the reader and one in-process Translator; the subprocess
paths get a few (each costs a process start). The container's modes are in
test_properties_container.py.
"""
import io
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from decoder import textio
from fixture_model import WORDS, make_model_dir

# every byte sequence some reader treats as a line break, and CRLF
SEPARATORS = [b"\n", b"\r\n", b"\r", b"\x0b", b"\x0c", b"\x1c", b"\x1d", b"\x1e",
              "\x85".encode(), "\u2028".encode(), "\u2029".encode()]
# anything a line-based reader could split an output line on
BREAKS = set("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
DECODE = ["--precision", "fp32", "--max-len-a", "0.5", "--max-len-b", "3"]
pieces = st.one_of(
    st.binary(max_size=12),                                  # any bytes, invalid UTF-8 included
    st.sampled_from(SEPARATORS),
    st.sampled_from(WORDS).map(lambda w: w.encode() + b" "),  # tokens the model knows
    st.text(max_size=8).map(lambda s: s.encode("utf-8", "surrogatepass")),
)
stdins = st.lists(pieces, max_size=40).map(b"".join)  # empty input and no final newline included


def n_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("prop") / "model", enc=1, dec=1, seed=5, max_positions=64)


@pytest.fixture(scope="module")
def translator(model_dir):
    from decoder import Translator
    with Translator(model_dir, precision="fp32", threads=1, max_len_a=0.5, max_len_b=3, chunk_lines=7) as tr:
        yield tr


def reader_lines(data: bytes, max_bytes=None) -> list[str]:
    return list(textio.read_lines(io.BytesIO(data), max_bytes))


@settings(max_examples=200, deadline=None)
@given(stdins, st.one_of(st.none(), st.integers(1, 20)))
def test_reader_gives_one_line_per_newline_in_order(data, cap):
    got = list(textio.split_lines(io.BytesIO(data), cap))
    assert len(got) == n_lines(data)
    for line, full in zip(got, data.split(b"\n")):
        if cap is None or len(full) <= cap:
            assert line == full.rstrip(b"\r")
        else:  # the first cap bytes, less a character the cut split (at most 3 bytes)
            assert any(line == full[:cap - k].rstrip(b"\r") for k in range(4))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stdins)
def test_translator_gives_one_unbroken_line_per_input_line_in_order(translator, data):
    lines = reader_lines(data, textio.line_cap(64))
    out = translator.translate(lines)
    assert len(out) == len(lines) == n_lines(data)
    assert not any(BREAKS & set(o) for o in out)
    assert all(o == "" for x, o in zip(lines, out) if not x.strip())
    # in order: each line translated alone gives the same output (batching does not change tokens)
    assert out == [translator.translate([x])[0] for x in lines]


def cli(model_dir, data: bytes, *args) -> bytes:
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "decoder", "--model", model_dir, *DECODE, *args],
                       input=data, capture_output=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return r.stdout


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(stdins, min_size=1, max_size=6).map(b"".join))
def test_cli_threads_workers_and_in_process_give_the_same_lines(model_dir, translator, data):
    want = "".join(x + "\n" for x in translator.translate(reader_lines(data, textio.line_cap(64))))
    one = cli(model_dir, data, "--threads", "1", "--set", "chunk_lines=7")
    assert one.count(b"\n") == n_lines(data)
    assert one.decode("utf-8") == want
    assert cli(model_dir, data, "--workers", "2", "--set", "chunk_lines=5") == one
