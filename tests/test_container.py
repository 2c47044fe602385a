"""The submission container, built and run for real (docker SDK).

Every run uses --network none --memory 2g --cpus 2, as the task's evaluation
does. The image is keyed on its inputs (submission/image.py), so a second
session with an unchanged tree reuses it; the first build is a few minutes.
"""
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest

from fixture_model import make_model_dir, synthetic_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIBLE_TINY = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")
CPUS = 2
pytestmark = pytest.mark.slow


def docker_or_skip():
    try:
        import docker
        c = docker.from_env(timeout=30)
        c.ping()
        return c
    except Exception as e:
        why = ""
        marker = os.path.join(ROOT, "build", "docker-unavailable")
        if os.path.isfile(marker):
            why = open(marker).read().strip() + "; "
        pytest.skip(f"no docker daemon: {why}{str(e).splitlines()[0][:150]} (.ci/run starts one as root)")


@pytest.fixture(scope="module")
def model_dir():
    """The trained fixture when present (real sentences); else a small random
    model kept under build/: SentencePiece training is not bit-reproducible,
    and a new spm.model would change the image key and force a rebuild."""
    if os.path.isfile(os.path.join(BIBLE_TINY, "model.safetensors")):
        return BIBLE_TINY
    src = open(os.path.join(ROOT, "tests", "fixture_model.py"), "rb").read()
    path = os.path.join(ROOT, "build", f"container-test-model-{hashlib.sha256(src).hexdigest()[:12]}")
    if not os.path.isfile(os.path.join(path, "spm.model")):  # spm.model is written last
        shutil.rmtree(path, ignore_errors=True)
        make_model_dir(path, vocab_size=300, d_model=64)
    return path


@pytest.fixture(scope="module")
def image(model_dir):
    docker_or_skip()
    from submission.image import build
    return build(model_dir, quiet=True)


def run(image, command=None, stdin=b"", **kw):
    from submission.dockerrun import run as docker_run
    return docker_run(image, command, stdin, nano_cpus=CPUS * 10**9, **kw)


def reference(model_dir, stdin: bytes, args: list[str], precision: str = "auto") -> bytes:
    """`python -m decoder` on the host: what the container must reproduce (the default precision,
    and the shortlist when the model dir has one: serve.settings). Pass the container's
    `chosen_precision` to compare with what it printed."""
    return _reference(model_dir, stdin, tuple(args), precision)


@functools.lru_cache(maxsize=None)  # several tests compare with one run (a process start and a decode each)
def _reference(model_dir, stdin: bytes, args: tuple, precision: str) -> bytes:
    from submission.container.serve import has_shortlist
    shortlist = ["--shortlist"] if has_shortlist(model_dir) else []
    r = subprocess.run([sys.executable, "-m", "decoder", "--model", model_dir, "--precision", precision,
                        *shortlist, *args],
                       input=stdin, capture_output=True, cwd=ROOT, check=True)
    return r.stdout


def chosen_precision(stderr: bytes) -> str:
    """The precision the container ran, from its settings line (fp32 and int8 differ in tokens)."""
    m = re.search(rb"decoder: precision (\w+)", stderr)
    assert m, stderr[-2000:]
    return m.group(1).decode()


def own_stderr(b: bytes) -> list[str]:
    """The container's stderr lines but the one settings line serve.py prints at start."""
    err = b.decode().splitlines()
    assert sum(x.startswith("decoder: precision ") for x in err) == 1, err
    return [x for x in err if not x.startswith("decoder: precision ")]


def lines(b: bytes) -> list[bytes]:
    return b.split(b"\n")[:-1] if b.endswith(b"\n") else b.split(b"\n")


TEXT = ("\n".join(synthetic_corpus(40, seed=3)) + "\n").encode()


def test_image_is_small_non_root_and_without_compilers(image):
    import docker
    size = docker.from_env().images.get(image).attrs["Size"]
    assert size <= 1.2e9, f"image is {size / 1e6:.0f} MB"
    r = run(image, ["sh", "-c", "id -u; command -v gcc cc g++ c++ clang || true; ls /model"])
    uid, *rest = r.stdout.decode().split()
    assert uid != "0"
    assert rest == ["config.json", "model.safetensors", "spm.model"]  # no compiler paths


def test_image_holds_the_runtime_and_the_payload_only(image):
    from submission.image import sources
    r = run(image, ["sh", "-c", "cd /app && find . -name '*.py' | sort"])
    in_image = {p[2:] for p in r.stdout.decode().split()}
    assert in_image == {f for f in sources() if f.endswith(".py")}
    assert not any(f.startswith(("tools/", "submission/evaluate/", "tests/")) for f in in_image)


# the decoder settings of each /run.sh mode (serve.py): CPU-ALL throughput runs
# one pinned 1-thread worker process per core, CPU-ALL latency one thread per core
ONE = ["--threads", "1"]
ALL_THROUGHPUT = ["--workers", str(CPUS)] if CPUS > 1 else ONE
# latency: one sentence a batch (serve.settings), so auto probes and pads as the container does
ONE_LATENCY = ONE + ["--batch-size", "1"]
ALL_LATENCY = ["--threads", str(CPUS), "--batch-size", "1"]


@pytest.mark.parametrize("hardware,args", [("CPU-1", ONE), ("CPU-ALL", ALL_THROUGHPUT)])
def test_throughput_output_equals_python_m_decoder(image, model_dir, hardware, args):
    r = run(image, ["/run.sh", hardware, "throughput"], TEXT)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == reference(model_dir, TEXT, args, chosen_precision(r.stderr))
    assert own_stderr(r.stderr) == []


def test_plain_docker_run_is_cpu_all_throughput_without_a_gpu(image, model_dir):
    r = run(image, None, TEXT)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == reference(model_dir, TEXT, ALL_THROUGHPUT, chosen_precision(r.stderr))


def test_gpu_mode_without_cuda_warns_once_and_runs_on_cpu(image, model_dir):
    r = run(image, ["/run.sh", "GPU", "throughput"], TEXT)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == reference(model_dir, TEXT, ALL_THROUGHPUT, chosen_precision(r.stderr))
    assert r.stderr.decode().count("warning") == 1 and b"CUDA" in r.stderr


@pytest.mark.parametrize("hardware", ["CPU-1", "CPU-ALL"])
def test_latency_mode_answers_each_line_before_the_next_is_written(image, model_dir, hardware):
    from submission.dockerrun import Session
    sents = synthetic_corpus(5, seed=7)
    s = Session(image, ["/run.sh", hardware, "latency"], nano_cpus=CPUS * 10**9)
    try:
        answers = []
        for sent in sents:
            s.write(sent.encode() + b"\n")
            # stdin stays open: an answer can only come from line-at-a-time mode
            answers.append(s.read_until(1, timeout=120))
        s.close_stdin()
        r = s.wait(timeout=120)
        assert r.exit_code == 0 and r.stdout == b"", r.stderr
    finally:
        s.remove()
    ref = reference(model_dir, ("\n".join(sents) + "\n").encode(),
                    ONE_LATENCY if hardware == "CPU-1" else ALL_LATENCY, chosen_precision(r.stderr))
    assert answers == [x + b"\n" for x in lines(ref)]


def test_throughput_streams_output_before_input_ends(image):
    """Output of the first chunk (20,000 lines) arrives while stdin is still
    open: the input is never held whole, so memory is bounded by the chunk."""
    from submission.dockerrun import Session
    s = Session(image, ["/run.sh", "CPU-ALL", "throughput"], nano_cpus=CPUS * 10**9)
    try:
        s.write(b"the man sees the dog.\n" + b"\n" * 49_999)
        assert s.read_until(10_000, timeout=120).count(b"\n") >= 10_000
        s.close_stdin()
        r = s.wait(timeout=120)
        assert r.exit_code == 0, r.stderr
    finally:
        s.remove()


BAD = [b"", b"the man sees the dog.", b"", b"caf\xc3 \xff\xfe broken utf-8", b"windows line\r",
       b"nul\x00inside", b"form\x0cfeed, vertical\x0btab, \x1c\x1d\x1e separators",
       "unicode\u2028line\u2029separators\x85nel".encode(), b"\r", b"   ",
       b" ".join([b"word"] * 10_000)]


@pytest.mark.parametrize("task", ["throughput", "latency"])
def test_bad_input_keeps_one_output_line_per_input_line(image, model_dir, task):
    stdin = b"\n".join(BAD) + b"\nlast line without newline"
    r = run(image, ["/run.sh", "CPU-ALL", task], stdin)
    assert r.exit_code == 0, r.stderr
    out = lines(r.stdout)
    assert len(out) == len(BAD) + 1
    for i, src in enumerate(BAD):
        if not src.strip():
            assert out[i] == b"", f"line {i} should stay empty"
    err = own_stderr(r.stderr)
    assert len(err) == 1 and "truncat" in err[0], err
    assert r.stdout == reference(model_dir, stdin, ALL_THROUGHPUT if task == "throughput" else ALL_LATENCY,
                                 chosen_precision(r.stderr))


def test_million_lines_stream_through_2g(image):
    # mostly empty lines: the reading/writing path at full length, ~100 translations
    block = b"the man sees the dog.\n" + b"\n" * 9_999
    r = run(image, ["/run.sh", "CPU-ALL", "throughput"], block * 100, mem_limit="2g")
    assert r.exit_code == 0 and not r.oom_killed, r.stderr[-500:]
    assert r.stdout.count(b"\n") == 1_000_000
    assert lines(r.stdout).count(b"") >= 999_900  # empty lines stayed empty


def test_cpu_all_throughput_under_512m_translates_every_line(image, model_dir):
    """A parent and a worker per core peak at about 600 MiB; under 512m the
    workers were OOM-killed (exit 1, no output). The memory limit now bounds the
    worker count (decoder/cgroup.py): one process, every line, same output."""
    text = ("\n".join(synthetic_corpus(3000, seed=5)) + "\n").encode()
    r = run(image, ["/run.sh", "CPU-ALL", "throughput"], text, mem_limit="512m", memswap_limit="512m")
    assert r.exit_code == 0 and not r.oom_killed, r.stderr[-500:]
    assert r.stdout == reference(model_dir, text, ONE, chosen_precision(r.stderr))
    assert own_stderr(r.stderr) == []


@pytest.mark.parametrize("damage", ["missing", "empty", "corrupt-weights", "bad-config"])
def test_missing_or_corrupt_model_exits_nonzero_with_one_error(image, model_dir, tmp_path, damage):
    bad = tmp_path / "model"
    bad.mkdir()
    if damage != "empty":
        for f in ("config.json", "model.safetensors", "spm.model"):
            (bad / f).write_bytes(open(os.path.join(model_dir, f), "rb").read())
        if damage == "missing":
            (bad / "spm.model").unlink()
        elif damage == "corrupt-weights":
            (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
        else:
            (bad / "config.json").write_text("{\"format_version\": 1, \"architecture\": ")
    os.chmod(bad, 0o755)
    for f in bad.iterdir():
        os.chmod(f, 0o644)
    r = run(image, ["/run.sh", "CPU-1", "throughput"], b"hello\n",
            volumes={str(bad): {"bind": "/model", "mode": "ro"}})
    assert r.exit_code != 0
    err = r.stderr.decode().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert r.stdout == b""


def test_bad_arguments_are_a_usage_error(image):
    r = run(image, ["/run.sh", "TPU", "throughput"], b"x\n")
    assert r.exit_code == 2 and b"usage" in r.stderr


def test_docker_stop_ends_a_running_translation_with_sigterms_status(image):
    """Python as PID 1 has no default action for SIGTERM: without serve.py's handler,
    `docker stop` waited its whole timeout and then killed the container (137)."""
    import time
    from submission.dockerrun import Session
    s = Session(image, ["/run.sh", "CPU-ALL", "throughput"], nano_cpus=CPUS * 10**9)
    try:
        s.write(TEXT)  # stdin stays open: the run waits for more input, workers and all
        end = time.monotonic() + 300
        while b"decoder: precision" not in bytes(s._err) and time.monotonic() < end:
            time.sleep(0.2)
        s.client.api.stop(s.id, timeout=120)  # SIGTERM, and SIGKILL only after 120 s
        r = s.finish(b"", timeout=120)
    finally:
        s.remove()
    assert r.exit_code == 128 + 15, r.stderr[-2000:]
    assert own_stderr(r.stderr) == ["error: stopped by SIGTERM"]


@pytest.mark.parametrize("pids", [8, 12])
def test_low_process_limit_gives_every_line_or_one_error_never_a_hang(image, model_dir, pids):
    """Under `--pids-limit 12` a worker could not start a thread and the run hung
    with no output. Now: the workers' start fails, one warning, and the parent
    translates every line itself; at 8 even the parent cannot start the threads of
    its pipeline: one error line. `run` fails on a container that outlives its timeout."""
    r = run(image, ["/run.sh", "CPU-ALL", "throughput"], TEXT, pids_limit=pids, timeout=300)
    err = own_stderr(r.stderr)
    assert "Traceback" not in r.stderr.decode()
    if r.exit_code == 0:
        assert r.stdout == reference(model_dir, TEXT, ONE, chosen_precision(r.stderr))
        # a worker that started may still die of the limit later: SentencePiece's batch calls
        # start a thread pool per call and abort the process when refused ("terminate called
        # without an active exception"); the pool then finishes with fewer workers, as after
        # an OOM kill, with its warning
        assert not [x for x in err if x.startswith("error:")], err
    else:
        assert [x for x in err if x.startswith("error: ")] == err[-1:] and r.stdout == b"", err
