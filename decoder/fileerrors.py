"""One line for every failure of the file system and every refused file, in every command.

    @fileerrors.one_line
    def main(argv=None) -> int: ...

A full disk, a read-only mount, a permission, a name that is not a directory, a
file refused for what it is (a pickle that is not a weights-only checkpoint, a
device where a regular file belongs, a dir that is not the command's to replace,
a run dir another run holds): each is one `error: ...` line on stderr and a
non-zero status, never a traceback, whichever command meets it and wherever.
The commands share this one mapping instead of a list of exceptions each.

Temp names in a message are the names the user gave (`OUT.tmp.PID` -> `OUT`):
the temp files are gone by the time the line is read (decoder/durable.py).
"""
from __future__ import annotations

import errno
import functools
import os
import pickle
import re
import sys

# Exit status: a failure of the disk while working (1, as the decoder's failed write), and
# a name that leads nowhere or a file refused for what it is (2, as every bad input of the kit).
FAILED, REFUSED = 1, 2
BAD_NAME = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG}

WORDS = {
    errno.ENOSPC: "no space left on the device (the disk is full)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "not a directory",
    errno.EISDIR: "is a directory",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "already exists",
    errno.ENOTEMPTY: "directory not empty",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENAMETOOLONG: "file name too long",
    errno.EIO: "input/output error (a failing disk?)",
    errno.EMFILE: "too many open files",
    errno.EFBIG: "file too large",
    errno.EXDEV: "on another file system",
    errno.EBUSY: "device or resource busy",
}

_TMP_FILE = re.compile(r"\.tmp\.\d+$")                         # durable.tmp_name
_TMP_DIR = re.compile(r"(^|/)\.([^/]+)\.tmp\.\d+\.[0-9a-z_]+(?=/|$)")  # durable.make_tmp_dir


class Refused(Exception):
    """A file or dir refused for what it is, not for a failing disk; str(e) is one line naming it."""


def user_name(path) -> str:
    """The name the user knows for a path the kit writes through a temp name."""
    p = _TMP_DIR.sub(r"\1\2", str(path))
    return _TMP_FILE.sub("", p)


def os_line(e: OSError) -> str:
    """An OSError as one line: the file, then why, in words."""
    why = WORDS.get(e.errno) or (e.strerror or str(e) or type(e).__name__).lower()
    names = [user_name(n) for n in (e.filename, e.filename2) if n is not None]
    names = [n for i, n in enumerate(names) if n not in names[:i]]
    return f"{' -> '.join(names)}: {why}" if names else why


def describe(e: BaseException) -> tuple[str, int] | None:
    """(the error line without `error: `, the exit status) of a file-system failure or a
    refused file, or None for anything else (left to raise: a bug is a traceback)."""
    if isinstance(e, BrokenPipeError):
        return None  # the reader of stdout went away: cliargs.run ends quietly
    if isinstance(e, Refused):
        return str(e).splitlines()[0] if str(e) else type(e).__name__, REFUSED
    if isinstance(e, pickle.UnpicklingError):
        return ("refused: not a weights-only torch checkpoint (arbitrary pickles are never loaded)",
                REFUSED)
    e = as_os_error(e)
    if isinstance(e, OSError):
        # no errno: the kit's own words ("RUN: no ckpt-*.pt step checkpoints"), a refusal
        return os_line(e), REFUSED if e.errno in BAD_NAME or e.errno is None else FAILED
    return None


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # Rust's io::Error (safetensors)


def as_os_error(e: BaseException) -> BaseException:
    """`e`, or the OSError a library's own exception wraps (safetensors' SafetensorError
    says "... (os error 28)" for a full disk)."""
    if not isinstance(e, OSError) and (m := _OS_ERROR.search(str(e))):
        n = int(m[1])
        return OSError(n, os.strerror(n))
    return e


def with_name(e: BaseException, path: str) -> BaseException:
    """`e` naming `path` when it is an OSError that names no file (a write or an fsync on a
    descriptor)."""
    if isinstance(e, OSError) and e.filename is None and e.errno is not None:
        e.filename = path
    return e


def one_line(main):
    """main(...) with every file-system failure and refused file as one `error:` line and its
    status (describe), not a traceback."""
    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - describe() picks ours, the rest is re-raised
            said = describe(e)
            if said is None:
                raise
            print(f"error: {said[0]}", file=sys.stderr, flush=True)
            return said[1]
    return guarded
