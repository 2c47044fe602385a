"""Files and dirs that are, after a crash or a power loss, either the previous
version or the whole new one, never a part.

One pattern for every output the kit publishes: write a temp file (or dir)
next to the target, fsync its contents, rename it over the target, then fsync
the parent directory. The rename is an entry in the directory, so without the
last fsync a power loss can undo it, or keep it while the file's data, never
flushed, reads back empty. A completion marker (a stage's done.json) is
written this way only after `fsync_tree` of everything it vouches for.

Temp names are `TARGET.tmp.PID`: a later run can tell a dead writer's leftover
from a live one's (student/train/trainer.py:remove_stale_tmp). A signal that
stops a command removes the temp files being written (`remove_unfinished`,
called by decoder/lifecycle.py's handler).

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
import json
import os
import secrets
import shutil
import stat
from typing import Callable, Iterable

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


def publish(tmp: str, path: str) -> None:
    """Rename a finished temp file (or symlink) over `path`, durably."""
    user_modes(tmp)
    fsync_tree(tmp)
    os.replace(tmp, path)
    fsync_path(_parent(path))


def atomic_write(path: str, write: Callable[[str], object]) -> None:
    """`write(tmp)` creates the temp file; then it replaces `path` (a symlink's
    target). On an exception the temp file goes and `path` keeps its previous
    contents. A device, a FIFO or /dev/stdout is given to `write` itself."""
    target, in_place = resolve(path)
    if in_place:
        write(target)
        return
    with temporary(target) as tmp:
        write(tmp)
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


def write_json(path: str, obj, **kw) -> None:
    write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, **kw))


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
        os.rename(tmp, path)
        fsync_path(parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, path)
    except OSError:
        if replace or not os.path.isdir(path):
            raise
        return  # a concurrent writer published it between the check and the rename
    fsync_path(parent)


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
        write(tmp)
        publish_dir(tmp, path, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once published
    return path
