"""How the decoder's processes start and end (docs/reliability.md, "Output files"
and "Process lifecycle"): closed standard streams, what `-o` does to the file
system, SIGTERM and SIGINT, worker processes whose parent dies, and a worker
pool that cannot start."""
import errno
import multiprocessing as mp
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from decoder import durable
from fixture_model import make_model_dir, synthetic_corpus

ENV = dict(os.environ, PYTHONPATH=ROOT)
# runs killed on purpose: without the fused ops no build lock is held when the kill lands
# (lifecycle.release_ops_build covers it in the real runs; a test must not risk it)
KILLED_ENV = dict(ENV, DECODER_NO_CPP_OPS="1")
LINES = synthetic_corpus(12, seed=4)
TEXT = ("\n".join(LINES) + "\n").encode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model_dir(tmp_path_factory.mktemp("lifecycle") / "model", enc=1, dec=1, seed=2))


@pytest.fixture(scope="module")
def want(model_dir):
    """The translations of TEXT by a plain run."""
    r = subprocess.run(decoder(model_dir), input=TEXT, capture_output=True, env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout


def decoder(model_dir, *args, quiet=True):
    return [sys.executable, "-m", "decoder", "--model", model_dir, "--threads", "1", *(["-q"] if quiet else []),
            *args]


def serve(model_dir):
    return [sys.executable, "-m", "submission.container.serve", "--hardware", "CPU-1", "--model", model_dir]


def in_shell(cmd, redirect: str, stdin=b""):
    """`cmd` exec'd by sh with `redirect` (`<&-` closes stdin: a shell's job, as in the issue)."""
    return subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", *cmd], input=stdin, capture_output=True,
                          env=ENV, cwd=ROOT, timeout=300)


def one_error_line(stderr: bytes) -> str:
    err = stderr.decode().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# -- closed standard streams ---------------------------------------------------------

@pytest.mark.parametrize("entry", ["decoder", "serve"])
@pytest.mark.parametrize("redirect", ["<&-", ">&-"])
def test_closed_stdin_or_stdout_is_one_error_line(model_dir, entry, redirect):
    cmd = decoder(model_dir) if entry == "decoder" else serve(model_dir)
    r = in_shell(cmd, redirect, stdin=b"" if redirect == "<&-" else TEXT)
    assert r.returncode == 2
    assert ("input" if redirect == "<&-" else "output") in one_error_line(r.stderr)


def test_closed_stderr_keeps_every_stderr_line_out_of_the_output(model_dir, want):
    """With stderr closed, print(file=sys.stderr) wrote to stdout: the settings line
    (no -q here) became a line of the translations."""
    r = in_shell(decoder(model_dir, quiet=False), "2>&-", stdin=TEXT)
    assert r.returncode == 0
    assert r.stdout == want


def test_closed_stdin_and_stdout_are_fine_with_input_and_output_files(model_dir, want, tmp_path):
    (tmp_path / "in.txt").write_bytes(TEXT)
    r = in_shell(decoder(model_dir, "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt")), "<&- >&-")
    assert r.returncode == 0, r.stderr.decode()
    assert (tmp_path / "out.txt").read_bytes() == want


# -- what -o does to the file system ---------------------------------------------------

def no_temp_files(*dirs) -> bool:
    return not [f for d in dirs for f in os.listdir(d) if ".tmp." in f]


def test_writing_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "real.txt").write_text("old\n")
    os.symlink("models/real.txt", tmp_path / "link.txt")
    os.symlink(tmp_path / "models" / "absent.txt", tmp_path / "dangling.txt")
    durable.write_text(str(tmp_path / "link.txt"), "new\n")
    durable.write_text(str(tmp_path / "dangling.txt"), "made\n")
    assert os.path.islink(tmp_path / "link.txt") and os.readlink(tmp_path / "link.txt") == "models/real.txt"
    assert (tmp_path / "models" / "real.txt").read_text() == "new\n"
    assert os.path.islink(tmp_path / "dangling.txt") and (tmp_path / "models" / "absent.txt").read_text() == "made\n"
    assert no_temp_files(tmp_path, tmp_path / "models")


def test_write_link_replaces_the_link_itself_not_what_it_points_to(tmp_path):
    """A stage link of student.distill: re-pointed, while the dir it pointed to stays."""
    (tmp_path / "stage-a").mkdir()
    (tmp_path / "stage-b").mkdir()
    durable.write_link(str(tmp_path / "stage"), "stage-a")
    durable.write_link(str(tmp_path / "stage"), "stage-b")
    assert os.readlink(tmp_path / "stage") == "stage-b" and (tmp_path / "stage-a").is_dir()
    assert no_temp_files(tmp_path)


def test_a_fifo_or_a_device_is_written_in_place_never_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    durable.write_text(str(fifo), "through the fifo\n")
    reader.join(timeout=60)
    assert got == [b"through the fifo\n"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    null = tmp_path / "null"  # a node of /dev/null's own device, where this user may make one
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError:
        return  # no CAP_MKNOD: the FIFO above is the non-regular file
    durable.write_text(str(null), "gone\n")
    assert stat.S_ISCHR(os.lstat(null).st_mode) and no_temp_files(tmp_path)


def test_a_name_under_proc_is_the_open_file_it_names(tmp_path):
    """/dev/stdout is a link to /proc/self/fd/1: the file already open (here a pipe)."""
    r, w = os.pipe()
    try:
        os.symlink(f"/proc/self/fd/{w}", tmp_path / "out")
        assert durable.resolve("/dev/stdout")[1] and durable.resolve(str(tmp_path / "out"))[1]
        durable.write_text(str(tmp_path / "out"), "to the pipe\n")
        assert os.read(r, 100) == b"to the pipe\n" and os.path.islink(tmp_path / "out")
    finally:
        os.close(r)
        os.close(w)


def test_cli_output_onto_links_to_dev_null_and_stdout_leaves_both_links(model_dir, want, tmp_path):
    """Run as root, the rename replaced the device node (or /dev/stdout) with a regular
    file; the links here stand for them, so the old code breaks nothing outside tmp_path."""
    os.symlink("/dev/null", tmp_path / "null")
    os.symlink("/proc/self/fd/1", tmp_path / "stdout")
    r = subprocess.run(decoder(model_dir, "-o", str(tmp_path / "null")), input=TEXT, capture_output=True,
                       env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout == b"", r.stderr.decode()
    r = subprocess.run(decoder(model_dir, "-o", str(tmp_path / "stdout")), input=TEXT, capture_output=True,
                       env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout == want, r.stderr.decode()
    assert os.path.islink(tmp_path / "null") and os.path.islink(tmp_path / "stdout")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and no_temp_files(tmp_path)


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"no {what} in {timeout} s")
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_the_temp_output_and_exits_with_one_line(model_dir, tmp_path, sig):
    out = tmp_path / "out.txt"
    out.write_text("previous\n")
    # started as from a terminal: a suite run as a background job (`&`) ignores SIGINT, which
    # its children would inherit, and the decoder keeps a signal it was started ignoring
    p = subprocess.Popen(decoder(model_dir, "-o", str(out), "--chunk-lines", "1"), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=KILLED_ENV, cwd=ROOT,
                         preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    try:
        p.stdin.write(TEXT)  # and stdin stays open: the run is still going when the signal comes
        p.stdin.flush()
        tmp = tmp_path / f"out.txt.tmp.{p.pid}"
        wait_for(tmp.exists, 300, "temp output")
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 128 + sig
    assert one_error_line(err) == f"error: stopped by {signal.Signals(sig).name}"
    assert out.read_text() == "previous\n" and no_temp_files(tmp_path)


# -- process lifecycle ---------------------------------------------------------------

def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc: no psutil)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and process_state(int(d), parent=pid):
            out.append(int(d))
    return out


def process_state(pid: int, parent: int | None = None) -> str | None:
    """The state letter of a live (not zombie) process, optionally only a child of `parent`."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in "ZX" or (parent is not None and int(fields[1]) != parent):
        return None
    return fields[0]


def read_line(stream, timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no output line in {timeout} s"
    return stream.readline()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_and_resource_tracker_exit_when_the_parent_is_killed(model_dir, sig):
    """A killed parent closes nothing: its workers (a model copy each) and the
    multiprocessing resource tracker used to run on, forever."""
    p = subprocess.Popen(decoder(model_dir, "--workers", "2", "--chunk-lines", "1"), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=KILLED_ENV, cwd=ROOT)
    kids = []
    try:
        p.stdin.write(TEXT)
        p.stdin.flush()
        read_line(p.stdout, 300)  # the workers translate
        wait_for(lambda: len(children(p.pid)) >= 3, 120, "two workers and a resource tracker")
        kids = children(p.pid)
        p.send_signal(sig)
        p.wait(timeout=60)
        end = time.monotonic() + 60  # a deadline against a hang, not a speed requirement
        while [k for k in kids if process_state(k)] and time.monotonic() < end:
            time.sleep(0.1)
        left = [k for k in kids if process_state(k)]
        assert left == [], f"still running after the parent died: {left}"
        if sig == signal.SIGTERM:
            assert p.returncode == 143
            assert one_error_line(p.stderr.read()) == "error: stopped by SIGTERM"
    finally:
        p.kill()
        for k in kids:
            if process_state(k):
                os.kill(k, signal.SIGKILL)


class InWorkers:
    """A pool factory: the translator in the parent, `fail` in a worker process
    (picklable: a spawned worker imports this module)."""

    def __init__(self, model_dir: str, fail: str):
        self.model_dir, self.fail = model_dir, fail

    def __call__(self):
        from decoder import Translator
        if mp.parent_process() is not None:
            if self.fail == "thread":  # what a worker meets under `docker run --pids-limit`
                raise RuntimeError("can't start new thread")
            os._exit(1)  # dies while starting, without a word
        return Translator(self.model_dir, precision="fp32", threads=1)


def batches_and_reference(model_dir):
    from decoder import Translator
    one = Translator(model_dir, precision="fp32", threads=1)
    batches = [one.text.encode(LINES[i:i + 4]) for i in range(0, len(LINES), 4)]
    return batches, [one.translate_ids(b) for b in batches]


def pool_falls_back(model_dir, how: str, capfd) -> list[str]:
    """A 2-worker pool whose workers fail `how` translates every batch as one process
    would and keeps no worker; returns its stderr lines."""
    from decoder.workers import WorkerPool
    batches, ref = batches_and_reference(model_dir)
    capfd.readouterr()
    pool = WorkerPool(InWorkers(model_dir, how), 2)
    try:
        assert [pool.submit(b).result() for b in batches] == ref
        assert pool.n == 0 and pool.pids() == []
    finally:
        pool.close()
    return capfd.readouterr().err.splitlines()


def test_pool_whose_workers_cannot_start_a_thread_translates_in_process_with_one_warning(model_dir, capfd):
    err = pool_falls_back(model_dir, "thread", capfd)
    assert err == ["warning: translation worker processes could not start (RuntimeError: can't start new "
                   "thread); translating in this process"], err


def test_pool_whose_workers_die_while_starting_finishes_in_process(model_dir, capfd):
    err = pool_falls_back(model_dir, "exit", capfd)
    assert err and all(x.startswith("warning: ") for x in err) and len(err) <= 2, err


def test_pool_that_cannot_spawn_a_process_translates_in_process_with_one_warning(model_dir, capfd, monkeypatch):
    def refuse(self):
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))  # fork under a process limit
    monkeypatch.setattr(mp.get_context("spawn").Process, "start", refuse)
    err = pool_falls_back(model_dir, "thread", capfd)
    assert len(err) == 1 and err[0].startswith("warning: translation worker processes could not start"), err


POOL_WITH_A_THREAD_REFUSED = """
import sys, threading
from functools import partial
import concurrent.futures.process as cfp
from decoder import Translator
from decoder.workers import WorkerPool
model, what = sys.argv[1:]
if what == "feeder":  # the thread that feeds the workers' call queue (observed under --pids-limit 12)
    start = threading.Thread.start
    def refuse(self):
        if self.name == "QueueFeederThread":
            raise RuntimeError("can't start new thread")
        return start(self)
    threading.Thread.start = refuse
else:  # the executor's manager thread dies, whatever the cause
    def die(self):
        raise RuntimeError("can't start new thread")
    cfp._ExecutorManagerThread.run = die
one = Translator(model, precision="fp32", threads=1)
batch = one.text.encode(["the man sees the dog", "a cat"])
pool = WorkerPool(partial(Translator, model, threads=1), 2)
assert pool.submit(batch).result() == one.translate_ids(batch)
print(pool.n)
pool.close()
"""


@pytest.mark.parametrize("what", ["feeder", "manager"])
def test_pool_whose_own_thread_is_refused_translates_in_process_never_hangs(model_dir, what):
    """A thread the executor starts for itself, refused, used to end that thread and leave
    every job waiting forever (the run under `docker run --pids-limit 12` hung)."""
    try:
        r = subprocess.run([sys.executable, "-c", POOL_WITH_A_THREAD_REFUSED, model_dir, what],
                           capture_output=True, env=KILLED_ENV, cwd=ROOT, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the pool hung")
    assert r.returncode == 0 and r.stdout == b"0\n", r.stderr.decode()[-2000:]
    assert b"warning: translation worker processes could not start" in r.stderr


def test_sentencepiece_starts_no_more_threads_than_torchs_pool(monkeypatch):
    """SentencePiece's batch calls default to a thread per core each: a 1-thread worker
    under a process limit aborted when one was refused. Text gives it torch's count."""
    import sentencepiece as spm
    import torch

    from decoder.modeldir import load
    from decoder.pipeline import Text
    made = []
    real = spm.SentencePieceProcessor
    monkeypatch.setattr(spm, "SentencePieceProcessor", lambda **kw: made.append(kw) or real(**kw))
    cfg, _, spm_path = load(os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model"))
    made.clear()  # the loader may open the model to check it
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        Text(cfg, spm_path, cfg.arch.max_positions)
    finally:
        torch.set_num_threads(before)
    assert [kw.get("num_threads") for kw in made] == [1]
