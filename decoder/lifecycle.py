"""What a command owes the process it runs in: standard streams that may be
closed, and signals that stop it with one line.

A process can start with stdin, stdout or stderr closed (`<&-`, `>&-`,
`2>&-`). Python then sets sys.stdin/stdout/stderr to None, and the next file
the run opens takes the free descriptor, so a model file could become fd 1;
and `print(..., file=sys.stderr)` with sys.stderr None writes to stdout,
mixing warnings into the translations. `standard_streams()` puts /dev/null on
each closed descriptor before anything else is opened and says which were
closed, so that a command refuses to read or write a stream that is not there.

SIGTERM (`docker stop`, `kill`, a batch system's time limit), SIGINT (Ctrl-C)
and SIGHUP stop the run at once: the temp file of an output being written is
removed (decoder/durable.py), one line goes to stderr and the process exits
128 + the signal's number (143, 130, 129), the status a shell reports for a
process the signal killed. Python running as PID 1 (a container's entry) gets
no default action for SIGTERM: without a handler `docker stop` waits its full
timeout. The handler ends the process with os._exit rather than an
exception: unwinding would join the thread reading the input, which may wait
forever on a stdin that never ends. Worker processes exit on their own once
their parent is gone (decoder/workers.py).
"""
from __future__ import annotations

import errno
import os
import signal
import sys

STREAMS = ("stdin", "stdout", "stderr")  # file descriptors 0, 1, 2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def standard_streams() -> set[str]:
    """The standard streams this process started without ({"stdout"} for `>&-`);
    each closed descriptor now holds /dev/null, and sys.stderr writes there."""
    closed = set()
    for fd, name in enumerate(STREAMS):
        if getattr(sys, name) is not None:
            continue
        closed.add(name)
        try:
            os.fstat(fd)  # already taken by a file opened since the start: leave it
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if "stderr" in closed:
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    return closed


def closed_error(closed: set[str], stdin: bool = False, stdout: bool = False) -> str | None:
    """The error line of a run that needs a standard stream it does not have, or None."""
    if stdin and "stdin" in closed:
        return "error: standard input is closed: no input to read"
    if stdout and "stdout" in closed:
        return "error: standard output is closed: nowhere to write the output"
    return None


def thread_refused(e: BaseException) -> str | None:
    """The error line for `e` if it says a thread could not be started (EAGAIN: a
    process limit such as `docker run --pids-limit` counts threads too), else None."""
    text = str(e)
    if isinstance(e, RuntimeError) and ("can't start new thread" in text or os.strerror(errno.EAGAIN) in text):
        return f"error: cannot start a thread ({text}): the process limit is too low for this run"
    return None


def stop_on_signals() -> None:
    """SIGTERM, SIGINT and SIGHUP end the process at once, as the module says (main thread
    only). A signal this process was started ignoring (`nohup`, a background job's
    SIGINT) stays ignored."""
    for s in STOP_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _stop)
    # multiprocessing's resource tracker (a child process, started later: it inherits the
    # environment) frees the semaphores of a worker pool that a stop did not close; its
    # warning about them would be a second line
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))


def release_ops_build() -> None:
    """Removes the fused ops' build lock if this process is building or loading them
    (decoder/ops.py; torch's FileBaton): an exit that skips its release would leave the
    lock behind, and every later run would wait on it forever. A torch that flocks the file
    instead (2.14 on) needs nothing: the exit drops the flock."""
    ops = sys.modules.get("decoder.ops")
    if ops is None or not ops._lock.locked() or "ok" in ops._state or not ops.load_waits_on_lock_file():
        return
    try:
        os.remove(os.path.join(ops.default_build_dir(), "lock"))
    except Exception:
        pass


def _stop(signum: int, frame) -> None:
    from . import durable
    durable.remove_unfinished()
    release_ops_build()
    try:  # os.write: print() could be the very call this handler interrupted
        os.write(2, f"error: stopped by {signal.Signals(signum).name}\n".encode())
    except OSError:
        pass
    os._exit(128 + signum)
