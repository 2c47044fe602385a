"""Reading parallel text: user files (plain or .gz) and the embedded Bible (SWORD modules)."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import zlib

from tqdm import tqdm

from decoder import durable, textio

SWORD_PATH = os.environ.get("SWORD_PATH", "/usr/share/sword")
SWORD_PACKAGES = ["sword-text-web", "sword-text-sparv"]
APT_COMMAND = "apt-get install -y --no-install-recommends " + " ".join(SWORD_PACKAGES)
# module name per language; the Spanish module drives the book walk because the
# English one also lists deuterocanonical books that have no Spanish side
BIBLE_MODULES = {"en": "engWEB2015eb", "es": "spaRV1909eb"}
BIBLE_TEST_BOOK, BIBLE_DEV_BOOK = "Acts", "Judges"


class DataError(Exception):
    """A problem with the user's data or setup; the CLI prints it as one line."""


def read_lines(path: str) -> tuple[list[str], int]:
    """Lines of a plain or gzipped UTF-8 file, stripped; returns (lines, lines with invalid UTF-8).

    decoder.textio's reader: it splits on '\\n' only (str.splitlines would also split
    on U+2028, \\x1c, ... and silently shift one side of a parallel corpus against the other).
    """
    reader = Lines(path)
    lines = list(reader)
    return lines, reader.bad


class Lines:
    """read_lines as a stream: iterate for the stripped lines; `bad` counts those with invalid
    UTF-8 read so far, `n` all of them. raw() gives the lines undecoded (a pool decodes them)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file")
        self.path, self.bad, self.n = path, 0, 0

    def __iter__(self):
        for raw in self.raw():
            line, bad = decode_line(raw)
            self.bad += bad
            yield line

    def raw(self):
        """The lines as bytes, without their line ending, neither decoded nor stripped."""
        gz = False
        try:
            with open(self.path, "rb") as fh:
                gz = fh.read(2) == b"\x1f\x8b"  # only to name the failure; open_binary sniffs too
            with textio.open_binary(self.path) as fh:
                for raw in textio.split_lines(fh):
                    self.n += 1
                    yield raw
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise DataError(f"{self.path}: {'truncated or corrupt gzip' if gz else 'unreadable'} ({e})") from None


def decode_line(raw: bytes) -> tuple[str, bool]:
    """(the line's text, stripped; whether it held invalid UTF-8, replaced by U+FFFD)."""
    try:
        return raw.decode("utf-8").strip(), False
    except UnicodeDecodeError:
        return textio.decode(raw).strip(), True


# the ASCII characters str.strip() removes (str.isspace): a line of only these is empty
_ASCII_SPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"


def has_text(raw: bytes) -> bool:
    """Whether decode_line(raw) is non-empty, mostly without decoding: a line whose first byte
    past the ASCII spaces is ASCII starts with a character strip() keeps."""
    raw = raw.strip(_ASCII_SPACE)
    if not raw:
        return False
    return raw[0] < 0x80 or bool(decode_line(raw)[0])


def read_parallel(src: str, tgt: str) -> tuple[list[tuple[str, str]], int]:
    """Pairs from two line-aligned files; returns (pairs, lines with invalid UTF-8)."""
    s, bad_s = read_lines(src)
    t, bad_t = read_lines(tgt)
    if len(s) != len(t):
        raise DataError(f"line counts differ: {src} has {len(s)} lines, {tgt} has {len(t)} lines")
    return list(zip(s, t)), bad_s + bad_t


class Parallel:
    """Pairs of two line-aligned files as a stream; a length mismatch is a DataError once the
    shorter file ends (naming both counts). `bad` counts lines with invalid UTF-8."""

    def __init__(self, src: str, tgt: str):
        self.src, self.tgt = Lines(src), Lines(tgt)

    @property
    def bad(self) -> int:
        return self.src.bad + self.tgt.bad

    def __iter__(self):
        return self._zip(iter(self.src), iter(self.tgt))

    def raw(self):
        """The pairs as raw lines (Lines.raw); `bad` counts none of them."""
        return self._zip(self.src.raw(), self.tgt.raw())

    def _zip(self, s, t):
        for a in s:
            b = next(t, None)
            if b is None:
                self._mismatch(s, t)
            yield a, b
        if next(t, None) is not None:
            self._mismatch(s, t)

    def _mismatch(self, s, t):
        for _ in s:
            pass
        for _ in t:
            pass
        raise DataError(f"line counts differ: {self.src.path} has {self.src.n} lines, "
                        f"{self.tgt.path} has {self.tgt.n} lines")


def count_nonempty_pairs(src: str, tgt: str, verbose: bool = False) -> tuple[int, int]:
    """(pairs, pairs with both sides non-empty) of two files, streamed: the seeded split's first pass."""
    n = ok = 0
    for a, b in tqdm(Parallel(src, tgt).raw(), desc="counting", unit="pair", unit_scale=True, miniters=10_000,
                     delay=1, disable=not verbose):
        n += 1
        ok += has_text(a) and has_text(b)
    return n, ok


def write_lines(path: str, lines) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for line in lines:
            fh.write(line + "\n")


def ensure_sword_modules(verbose: bool = True) -> None:
    """Install the Bible packages with apt when we are root, else say exactly what to run."""
    if _missing_modules():
        if os.geteuid() == 0 and shutil.which("apt-get"):
            if verbose:
                print(f"installing Debian packages: {' '.join(SWORD_PACKAGES)}", flush=True)
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            for cmd in ("apt-get update -qq", APT_COMMAND + " -qq"):
                if subprocess.run(cmd.split(), env=env, stdout=subprocess.DEVNULL).returncode:
                    raise DataError(f"`{cmd}` failed; the embedded corpus needs: {APT_COMMAND}")
        missing = _missing_modules()
        if missing:
            raise DataError(f"SWORD modules {', '.join(missing)} not found in {SWORD_PATH}; "
                            f"install them with: sudo {APT_COMMAND}")


def _missing_modules() -> list[str]:
    from pysword.modules import SwordModules
    try:
        found = SwordModules(SWORD_PATH).parse_modules() if os.path.isdir(SWORD_PATH) else {}
    except Exception:  # pysword raises on a half-present install; treat it as missing
        found = {}
    return [m for m in BIBLE_MODULES.values() if m not in found]


def _open_bible(module: str):
    from pysword.modules import SwordModules
    bible = SwordModules(SWORD_PATH)
    bible.parse_modules()
    bible = bible.get_bible_from_module(module)
    # pysword decompresses a whole block for every verse; caching blocks takes the
    # extraction from minutes to seconds
    bible._decompressed_text = functools.lru_cache(maxsize=None)(bible._decompressed_text)
    return bible


def extract_bible(out_dir: str, verbose: bool = True) -> str:
    """Write en.txt, es.txt and book.txt (one verse per line) to out_dir once; returns out_dir."""
    if os.path.isdir(out_dir):
        return out_dir
    ensure_sword_modules(verbose)
    en, es = _open_bible(BIBLE_MODULES["en"]), _open_bible(BIBLE_MODULES["es"])
    books = [b for testament in es.get_structure().get_books().values() for b in testament]
    lines = {"en": [], "es": [], "book": []}
    for book in tqdm(books, desc="extracting bible", unit="book", disable=not verbose):
        for chapter, n_verses in enumerate(book.chapter_lengths, 1):
            for verse in range(1, n_verses + 1):
                ref = dict(books=[book.name], chapters=[chapter], verses=[verse])
                # removed markup leaves runs of spaces and newlines
                lines["en"].append(" ".join(en.get(**ref).split()))
                lines["es"].append(" ".join(es.get(**ref).split()))
                lines["book"].append(book.name)

    def write(tmp: str) -> None:
        for name, content in lines.items():
            write_lines(os.path.join(tmp, f"{name}.txt"), content)
    return durable.write_dir(out_dir, write, replace=False)  # a concurrent run that got there first wins
