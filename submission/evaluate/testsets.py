"""Where the test sentences come from: the embedded Bible test split, the user's
files, or a sacreBLEU named test set (downloaded, so only when online)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from decoder import textio

from .systems import EvalError


@dataclass
class TestSet:
    name: str
    src: list[str]
    refs: list[list[str]]   # one list per reference stream, each as long as src
    src_lang: str | None = None
    tgt_lang: str | None = None
    origin: str = ""         # the paths or the sacreBLEU id, for the report

    def head(self, n: int) -> "TestSet":
        if not n or n >= len(self.src):
            return self
        return TestSet(self.name, self.src[:n], [r[:n] for r in self.refs], self.src_lang, self.tgt_lang,
                       f"{self.origin} (first {n} lines)")


def _read(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise EvalError(f"{path}: no such file")
    return textio.read_file(path)  # `python -m decoder`'s reader: the same lines


def from_files(src: str, refs: list[str], src_lang: str | None = None, tgt_lang: str | None = None) -> TestSet:
    s = _read(src)
    if not s:
        raise EvalError(f"{src} is empty")
    rs = [_read(r) for r in refs]
    for path, r in zip(refs, rs):
        if len(r) != len(s):
            raise EvalError(f"{path} has {len(r)} lines but the source {src} has {len(s)}")
    if not (src_lang or tgt_lang):  # test.en + test.es: the pair is in the suffixes
        src_lang, tgt_lang = lang_suffix(src), lang_suffix(refs[0]) if refs else None
    return TestSet(os.path.basename(src), s, rs, src_lang, tgt_lang, " ".join([src, *refs]))


def lang_suffix(path: str) -> str | None:
    """`newstest2019.en` -> en, `test.pt_BR` -> pt_BR; `test.txt` -> None."""
    ext = os.path.splitext(path)[1][1:]
    return ext if re.fullmatch(r"[a-z]{2,3}([_-][A-Za-z]{2,4})?", ext) and ext not in ("txt", "src", "ref", "tgt") \
        else None


def embedded(vocab_size: int) -> TestSet:
    """The Bible en->es test split (Acts) of `student.data.prepare`. The split does not depend
    on the vocabulary; passing the models' vocabulary size reuses their prepared cache."""
    from student.data import prepare
    from student.data.corpus import DataError
    try:
        prep = prepare("bible-en-es", vocab_size=vocab_size, verbose=False)
    except DataError as e:
        raise EvalError(f"embedded test split: {e}") from None
    src_path, ref_path = prep.splits["test"]
    src, ref = prep.read("test")
    return TestSet("bible-en-es test", src, [ref], prep.src_lang, prep.tgt_lang, f"{src_path} {ref_path}")


def sacrebleu_set(test_set: str, langpair: str) -> TestSet:
    """`-t wmt22 -l en-de`: sacreBLEU downloads it once into ~/.sacrebleu (or $SACREBLEU)."""
    import logging

    from sacrebleu.dataset import DATASETS
    if test_set not in DATASETS:
        raise EvalError(f"unknown sacreBLEU test set {test_set!r} (`sacrebleu --list` names them)")
    ds = DATASETS[test_set]
    if langpair not in ds.langpairs:
        raise EvalError(f"sacreBLEU test set {test_set} has no language pair {langpair!r} "
                        f"(it has {', '.join(sorted(k for k in ds.langpairs if '-' in k))})")
    log = logging.getLogger("sacrebleu")
    level, log.level = log.level, logging.CRITICAL  # its own multi-line complaint; ours is one line
    try:
        src_path = ds.get_source_file(langpair)
        ref_paths = ds.get_reference_files(langpair)
    except (SystemExit, Exception) as e:  # sacreBLEU calls sys.exit(1) when a download fails
        raise EvalError(f"cannot fetch sacreBLEU test set {test_set} {langpair} (offline? it is "
                        f"downloaded on first use): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        ) from None
    finally:
        log.level = level
    ts = from_files(src_path, ref_paths, *langpair.split("-", 1))
    ts.name, ts.origin = f"{test_set} {langpair}", f"sacrebleu -t {test_set} -l {langpair}"
    return ts
