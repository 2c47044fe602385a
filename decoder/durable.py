"""Files and dirs that are, after a crash or a power loss, either the previous
version or the whole new one, never a part.

One pattern for every output the kit publishes: write a temp file (or dir)
next to the target, fsync its contents, rename it over the target, then fsync
the parent directory. The rename is an entry in the directory, so without the
last fsync a power loss can undo it, or keep it while the file's data, never
flushed, reads back empty. A completion marker (a stage's done.json) is
written this way only after `fsync_tree` of everything it vouches for.

Temp names are `TARGET.tmp.PID` (dirs: `.TARGET.tmp.PID.X`): a later run tells a
dead writer's leftover from a live one's and removes it (`remove_stale`). A
signal that stops a command removes the temp files being written
(`remove_unfinished`, called by decoder/lifecycle.py's handler). A rename or a
dir fsync that fails puts the previous file or dir back: a command that fails
leaves its target as it found it (`undone_on_failure` for several files).

A run dir has one writer at a time (`locked`: an advisory flock the kernel drops
when the process ends, however it ends).

What a file name means to a writer (`resolve`): a symlink is followed, so its
target is replaced and the link stays a link; an existing file that is not a
regular file (a device such as /dev/null, a FIFO) or a name under /proc
(/dev/stdout, /dev/fd/N) is written in place, never renamed over: run as
root, a rename would replace /dev/null with a regular file for the whole
system. `write_link` replaces a link itself. Files and dirs
get the modes the user's umask gives, as any other file they create (not
mkstemp's 0600 or mkdtemp's 0700): a model dir is meant to be shared.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
from typing import Callable, Iterable

from .fileerrors import Refused, as_os_error, with_name

_unfinished: set[str] = set()  # temp files being written now


def tmp_name(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


def remove_unfinished() -> None:
    """Removes the temp files of the writes in progress (a signal handler's cleanup)."""
    for tmp in list(_unfinished):
        try:
            os.remove(tmp)
        except OSError:
            pass


def resolve(path: str) -> tuple[str, bool]:
    """(where a write to `path` lands, whether it is written in place): symlinks
    followed; in place for a name under /proc or an existing non-regular file."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links in a path
        head, tail = os.path.split(p)
        head = os.path.realpath(head)
        p = os.path.join(head, tail)
        if head == "/proc" or head.startswith("/proc/"):
            return p, True  # /dev/stdout -> /proc/self/fd/1: a file already open, maybe a pipe
        if not os.path.islink(p):
            break
        p = os.path.normpath(os.path.join(head, os.readlink(p)))
    else:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        return p, False
    return p, not stat.S_ISREG(mode)


def fsync_path(path: str) -> None:
    """Flush one file's or one directory's contents to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        raise with_name(e, path)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync a file, or every file and dir under a dir (children before parents)."""
    if os.path.islink(path):
        return  # the link's name lives in its dir; fsync of the dir covers it
    if not os.path.isdir(path):
        fsync_path(path)
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                fsync_path(p)
        fsync_path(root)


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and put back at once
    os.umask(mask)
    return mask


def user_modes(path: str) -> None:
    """Give a file, or a dir and all under it, the modes the umask gives to what
    the user creates: some writers make 0600 files (safetensors' save_file,
    mkstemp) or 0700 dirs (mkdtemp). Executable bits stay executable."""
    mask = umask()

    def fix(p: str, st_mode: int) -> None:
        want = (0o777 if st_mode & 0o100 else 0o666) & ~mask
        if st_mode & 0o7777 != want:
            os.chmod(p, want)
    if os.path.islink(path):
        return
    if not os.path.isdir(path):
        fix(path, os.stat(path).st_mode)
        return
    for root, dirs, files in os.walk(path):
        fix(root, os.stat(root).st_mode | 0o100)
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                fix(p, os.stat(p).st_mode)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


@contextlib.contextmanager
def undone_on_failure(*paths: str):
    """The files at `paths` as they were if the block fails: for a command that replaces
    several files one after the other (a shortlist and the config that lists it)."""
    kept = {p: (os.path.lexists(p), _keep(p, ".undo")) for p in paths}
    try:
        yield
    except BaseException:
        for p, (existed, old) in kept.items():
            with contextlib.suppress(OSError):
                if old:
                    os.replace(old, p)
                elif not existed and os.path.lexists(p):
                    os.remove(p)
        raise
    finally:
        for old in (old for _, old in kept.values() if old):
            _unfinished.discard(old)
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)


def publish(tmp: str, path: str) -> None:
    """Rename a finished temp file (or symlink) over `path`, durably. If the rename or the
    fsync of the dir after it fails, `path` is put back as it was (its previous file kept
    meanwhile as a hard link), so a command that fails leaves it as it found it."""
    user_modes(tmp)
    fsync_tree(tmp)
    existed, old = os.path.lexists(path), _keep(path)
    try:
        os.replace(tmp, path)
        fsync_path(_parent(path))
    except BaseException:
        with contextlib.suppress(OSError):  # undo what went through; the first error is the one to tell
            if old:
                os.replace(old, path)
            elif not existed and not os.path.lexists(tmp):
                os.replace(path, tmp)  # the caller's clean-up removes it
        raise
    finally:
        if old:
            _unfinished.discard(old)
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)


def _keep(path: str, suffix: str = ".old") -> str | None:
    """A hard link to the regular file at `path` (None: none there, or no hard links here)."""
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    old = tmp_name(path + suffix)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(old)
        os.link(path, old)
    except OSError:
        return None
    _unfinished.add(old)
    return old


def atomic_write(path: str, write: Callable[[str], object], follow: bool = True) -> None:
    """`write(tmp)` creates the temp file; then it replaces `path` (a symlink's
    target). On an exception the temp file goes and `path` keeps its previous
    contents. A device, a FIFO or /dev/stdout is given to `write` itself.

    `follow=False` (a file of a model dir or run dir, a name the user did not
    give): whatever `path` is, a link included, the new file replaces the name
    itself; nothing outside the dir is ever written."""
    target, in_place = resolve(path) if follow else (os.path.abspath(path), False)
    if in_place:
        write(target)
        return
    with temporary(target) as tmp:
        try:
            write(tmp)
        except Exception as e:  # a write on a descriptor names no file: name the one the user knows
            raise with_name(as_os_error(e), target) from None
        publish(tmp, target)


def write_link(path: str, target: str) -> None:
    """`path` becomes a symlink to `target`, replacing what was there (a link too:
    the link itself, not what it points to)."""
    with temporary(path) as tmp:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(target, tmp)
        publish(tmp, path)


@contextlib.contextmanager
def temporary(path: str):
    """The temporary name beside `path`, removed if the block fails (a signal
    handler removes the ones still unfinished: `_unfinished`)."""
    tmp = tmp_name(path)
    _unfinished.add(tmp)
    try:
        yield tmp
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    finally:
        _unfinished.discard(tmp)


def write_text(path: str, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
    atomic_write(path, write)


def write_lines(path: str, lines: Iterable[str]) -> None:
    """One line per item, each ending in "\\n"."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
            fh.writelines(x + "\n" for x in lines)
    atomic_write(path, write)


class _Recorded:
    """A binary file whose first failed write is kept: a library that catches it and
    raises its own error instead (torch.save: "unexpected pos") is told by it."""

    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data):
        try:
            return self.fh.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name):
        return getattr(self.fh, name)


def write_through(path: str, save: Callable[[object], object]) -> None:
    """save(file) writes a new file at `path` through Python's writes; a failed write is
    raised as its own OSError (with its errno), whatever `save` made of it."""
    with open(path, "wb") as fh:
        rec = _Recorded(fh)
        try:
            save(rec)
        except Exception:
            if rec.error is not None:
                raise rec.error from None
            raise


def json_bytes(obj, **kw) -> bytes:
    return json.dumps(obj, indent=2, ensure_ascii=False, **kw).encode("utf-8")


def write_json(path: str, obj, **kw) -> None:
    write_text(path, json_bytes(obj, **kw).decode("utf-8"))


def write_bytes(path: str, data: bytes) -> None:
    """A new file holding `data`, written by Python: a failure is an OSError with its errno
    and the file's name (safetensors' save_file raises its own error, naming neither)."""
    write_through(path, lambda fh: fh.write(data))


def publish_dir(tmp: str, path: str, replace: bool = True) -> None:
    """Rename a finished temp dir to `path`, durably. An existing dir `path`
    is swapped out (`replace`), or else kept: another writer got there first
    with the same contents, and the caller removes `tmp`."""
    user_modes(tmp)
    fsync_tree(tmp)
    parent = _parent(path)
    if os.path.isdir(path) and not os.path.islink(path):
        if not replace:
            return
        old = tmp_name(path.rstrip("/") + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)  # a dir cannot be renamed over a non-empty one
        try:
            os.rename(tmp, path)
            fsync_path(parent)
        except BaseException:
            with contextlib.suppress(OSError):  # the previous dir back under its name
                if not os.path.lexists(tmp):
                    os.rename(path, tmp)
                os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, path)
    except OSError:
        if replace or not os.path.isdir(path):
            raise
        return  # a concurrent writer published it between the check and the rename
    try:
        fsync_path(parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(path, tmp)  # not there before, not there after a failure
        raise


def make_tmp_dir(path: str) -> str:
    """A new empty dir next to `path` (hidden, unique to this call) to build it in."""
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    while True:
        tmp = os.path.join(parent, f".{name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp, 0o777)  # the umask applies, as to every dir the user creates
            return tmp
        except FileExistsError:
            continue


def write_dir(path: str, write: Callable[[str], object], replace: bool = True) -> str:
    """`write(tmp)` fills a new temp dir; then it becomes `path` (publish_dir: an
    existing `path` is swapped out, or with `replace=False` kept). On an
    exception the temp dir goes and `path` stays as it was."""
    tmp = make_tmp_dir(path)
    try:
        try:
            write(tmp)
        except Exception as e:
            raise with_name(as_os_error(e), path) from None
        publish_dir(tmp, path, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once published
    return path


# -- leftovers of killed writers -------------------------------------------------------
_TEMP = re.compile(r"^(?P<hidden>\.)?(?P<name>.+)\.tmp\.(?P<pid>\d+)(?P<dir>\.[0-9a-z_]+)?$")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale(directory: str, names: Iterable[str] | None = None) -> list[str]:
    """Remove the temp files (`NAME.tmp.PID`) and temp dirs (`.NAME.tmp.PID.HEX`) that
    writers which are gone (a SIGKILL, a power loss) left in `directory`; with `names`,
    only those of these targets. A live process's temp, this one's included, is left
    alone. Returns the names removed."""
    wanted = None if names is None else set(names)
    gone = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return gone  # not there yet: nothing left over
    for f in entries:
        m = _TEMP.match(f)
        if not m or bool(m["hidden"]) != bool(m["dir"]) or (wanted is not None and m["name"] not in wanted):
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        p = os.path.join(directory, f)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.remove(p)
        except FileNotFoundError:
            continue  # another run cleaned it first
        gone.append(f)
    return gone


def remove_stale_beside(path: str) -> list[str]:
    """remove_stale for the temps of one target (a file or a dir) beside it."""
    target, in_place = resolve(path)
    if in_place:
        return []  # a device, a FIFO, /dev/stdout: written in place, never through a temp
    parent, name = os.path.split(target.rstrip("/"))
    return remove_stale(parent, [name, name + ".old", name + ".undo"])


# -- one writer per dir -----------------------------------------------------------------
LOCK = ".lock"


class Busy(Refused):
    """The dir is locked by a run that is still going."""


@contextlib.contextmanager
def locked(directory: str, what: str = "run dir"):
    """Hold `directory` for this process (created if missing): an advisory flock on
    DIR/.lock, which the kernel drops when the process ends however it ends. A second
    holder gets Busy naming the first one's pid. The lock file goes with the lock."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise Busy(f"{directory}: {what} in use by another run (process {holder}); "
                       f"wait for it to end, or choose another dir") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder before us removed this file on its way out: take the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
        os.close(fd)
