"""Teachers behind one interface: `translate(lines) -> lines`, same count, same order.

    CommandTeacher("apertium -u eng-spa")         any program, stdin -> stdout
    ModelTeacher([model_dir, ...], beam=4)        our model dirs; several = ensemble
    HFTeacher(hf_dir, beam=4)                     a local Hugging Face seq2seq dir (Marian, M2M100, NLLB, mBART)

`identity` is what the distilled corpus depends on (stage keys hash it). Every
teacher also has `name`, `engine`, `load()` (the one-time setup, apart so that
timing `translate` measures translation only), `engine_label()` (the engine as
a report names it, after load) and `size()`.
"""
from __future__ import annotations

import hashlib
import os
import subprocess

import sentencepiece as spm
import torch

from decoder import modeldir
from decoder.batching import pack
from decoder.machine import device_kind
from student.data import normalise
from student.data.pipeline import file_digest
from student.distill.beam import EnsembleSearch
from student.modeldir import load_model_dir
from student.train.batching import collate


class TeacherError(Exception):
    """The teacher failed or broke the one-line-in, one-line-out contract; one clear line."""


def dir_digest(path: str) -> str:
    """Content hash of every file in a dir (a model dir, an HF dir)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, path).encode() + b"\0")
            with open(p, "rb") as fh:
                hashlib.file_digest(fh, lambda: h)  # feeds the file into h
    return h.hexdigest()


class CommandTeacher:
    """Runs the command once per call (one shard), feeding the lines on stdin."""

    def __init__(self, cmd: str, timeout: float | None = None):
        if not cmd.strip():
            raise TeacherError("empty teacher command")
        self.cmd, self.timeout = cmd, timeout
        self.name = f"command: {cmd}"
        self.identity = {"type": "command", "cmd": cmd}
        self.engine = "external"

    def translate(self, lines: list[str], where: str = "") -> list[str]:
        # empty lines are not sent: some tools drop or merge them, and empty in = empty out anyway
        keep = [i for i, x in enumerate(lines) if x.strip()]
        out = [""] * len(lines)
        if not keep:
            return out
        data = "".join(lines[i].replace("\r", " ") + "\n" for i in keep).encode("utf-8")
        where = f" on {where}" if where else ""
        try:
            r = subprocess.run(self.cmd, shell=True, input=data, capture_output=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise TeacherError(f"teacher command `{self.cmd}` timed out after {self.timeout} s{where}") from None
        if r.returncode:
            err = r.stderr.decode("utf-8", "replace").strip()[-2000:] or "(no stderr)"
            raise TeacherError(f"teacher command `{self.cmd}` exited with status {r.returncode}{where}: {err}")
        text = r.stdout.decode("utf-8", "replace")
        # split on \n only: \r, U+2028 and friends inside a translation must not add lines
        got = text[:-1].split("\n") if text.endswith("\n") else (text.split("\n") if text else [])
        if len(got) != len(keep):
            raise TeacherError(f"teacher command `{self.cmd}` wrote {len(got)} lines for {len(keep)} "
                               f"input lines{where}; it must write exactly one line per input line")
        for i, y in zip(keep, got):
            out[i] = " ".join(y.split())  # tools collapse or double spaces; the student should not learn that
        return out

    def load(self):
        """Nothing to set up: the command starts afresh for each call."""

    def engine_label(self) -> str:
        return self.engine

    def size(self) -> dict:
        return {}


def lean_translator():
    """decoder.Translator when the lean decoder provides it, else None."""
    try:  # a probe, not an import: teachers and the report work on a tree without the lean decoder
        from decoder import Translator
    except ImportError:
        return None
    return Translator


class ModelTeacher:
    """Model dirs translated with beam search.

    engine "decoder": the lean decoder (one model only); "reference": the
    ensemble search in beam.py; "auto": the decoder when it exists and there is
    one model, else the reference search.
    """

    def __init__(self, model_dirs: list[str], beam: int = 4, engine: str = "auto", device: str | None = None,
                 precision: str = "fp32", max_tokens: int | None = None, max_sentences: int | None = None,
                 workers: int = 0):
        if isinstance(model_dirs, str):
            model_dirs = [model_dirs]
        if not model_dirs:
            raise TeacherError("no teacher model dir given")
        self.dirs, self.beam = [os.path.abspath(d) for d in model_dirs], beam
        for d in self.dirs:  # fail before any work, not at the first shard
            try:
                modeldir.read_config(d)
            except modeldir.ModelDirError as e:
                raise TeacherError(str(e)) from None
        self.device = torch.device(device or device_kind())
        # the lean decoder's precision (fp32 | bf16 | int8 | fp16 | auto); the reference search is fp32
        self.precision = precision
        Translator = lean_translator()
        if engine == "auto":
            engine = "decoder" if Translator is not None and len(self.dirs) == 1 else "reference"
        if engine == "decoder" and (Translator is None or len(self.dirs) != 1):
            raise TeacherError("engine 'decoder' needs decoder.Translator and exactly one model dir "
                               "(the lean decoder has no ensemble hook); use engine 'reference'")
        if engine not in ("decoder", "reference"):
            raise TeacherError(f"unknown engine {engine!r}")
        self.engine = engine
        self.batches = batch_options(engine, self.device.type, max_tokens, max_sentences)
        # the lean decoder's worker processes (decoder/workers.py): the output does not depend on them
        self.workers = workers if engine == "decoder" and self.device.type == "cpu" and workers > 1 else 0
        if engine == "decoder" and precision == "auto":  # resolved now: the identity names what runs
            from decoder.translator import resolve_device_precision
            self.precision = precision = resolve_device_precision(str(self.device), precision)[1]
        self.name = "model: " + " + ".join(self.dirs) + f" (beam {beam}, {engine}" + \
            (f", {precision}" + (f", {self.workers} workers" if self.workers else "") + ")"
             if engine == "decoder" else ")")
        self.identity = {"type": "model", "dirs": [dir_digest(d) for d in self.dirs], "beam": beam,
                         "engine": engine, **({"precision": precision} if engine == "decoder" else {})}
        self._Translator = Translator
        self._translator = None  # engine "decoder": the lean decoder, once loaded
        self._search = None      # engine "reference": (EnsembleSearch, spm, model config), once loaded

    def load(self):
        if self._translator is not None or self._search is not None:
            return
        try:
            if self.engine == "decoder":
                self._translator = self._Translator(self.dirs[0], beam=self.beam, device=str(self.device),
                                                    precision=self.precision, workers=self.workers,
                                                    **self.batches)
                if self._translator.pool is not None:  # loading the workers is not translation time
                    self._translator.pool.wait_started()
                return
            loaded = [load_model_dir(d) for d in self.dirs]
        except modeldir.ModelDirError as e:
            raise TeacherError(str(e)) from None
        if len({file_digest(os.path.join(d, modeldir.SPM)) for d in self.dirs}) > 1:
            raise TeacherError("ensemble members must share one spm.model: " + ", ".join(self.dirs))
        sp = spm.SentencePieceProcessor(model_file=os.path.join(self.dirs[0], modeldir.SPM))
        self._search = (EnsembleSearch([m.to(self.device) for m, _ in loaded], beam=self.beam), sp, loaded[0][1])

    def engine_label(self) -> str:
        """"decoder <precision it resolved to>[, N workers]" or "reference"."""
        self.load()
        if self._translator is None:
            return self.engine
        return f"{self.engine} {self._translator.precision}" + (f", {self.workers} workers" if self.workers else "")

    def close(self):
        """Stops the lean decoder's worker processes, if any."""
        if self._translator is not None:
            self._translator.close()
            self._translator = None

    def translate(self, lines: list[str], where: str = "") -> list[str]:
        self.load()
        if self.engine == "decoder":
            out = self._translator.translate(list(lines))
            if len(out) != len(lines):
                raise TeacherError(f"decoder.Translator returned {len(out)} lines for {len(lines)}"
                                   + (f" on {where}" if where else ""))
            return out
        search, sp, cfg = self._search
        a = search.models[0].args
        src = []
        for x in lines:
            ids = sp.encode(normalise(x, cfg.src_lang, cfg.normaliser)) if x.strip() else []
            src.append(ids[: a.max_positions // 2 - 1] + [a.eos_id])
        lens = [len(x) for x in src]
        order = sorted((i for i, x in enumerate(lines) if x.strip()), key=lens.__getitem__)
        out = [""] * len(lines)
        for idx in pack(order, lens, max(self.batches["max_tokens"] // self.beam, 1), self.batches["max_sentences"]):
            s, _, _ = collate(src, None, idx, a.pad_id, a.decoder_start_id, a.eos_id)
            for k, h in zip(idx, search(s.to(self.device))):
                out[k] = sp.decode(h)
        return out

    def size(self) -> dict:
        return model_dir_size(self.dirs[0]) if len(self.dirs) == 1 else {
            "params": sum(model_dir_size(d)["params"] for d in self.dirs),
            "bytes": sum(model_dir_size(d)["bytes"] for d in self.dirs), "members": len(self.dirs),
            "file": modeldir.WEIGHTS}


# The reference ensemble search's batches (padded source tokens x beam, sentences): on CPU what it
# always used; on a GPU about 8x the tokens and 16x the sentences, the decoder's GPU scale (32k tokens
# saturated an H100 in the decoder's throughput sweep).
REFERENCE_BATCHES = {"cpu": (6000, 64), "cuda": (49152, 1024)}


def batch_options(engine: str, device_type: str, max_tokens: int | None = None,
                  max_sentences: int | None = None) -> dict:
    """The batch settings a model teacher translates with, given ones winning. The lean decoder
    ("decoder"): on CUDA None for each it is not given, which the decoder reads as its device default
    (GPU-sized, for the beam); on CPU only the given ones, the decoder's CPU defaults being the measured
    ones. The reference search ("reference"): REFERENCE_BATCHES for the device, always numbers."""
    given = {k: v for k, v in (("max_tokens", max_tokens), ("max_sentences", max_sentences)) if v is not None}
    if engine == "decoder":
        return {"max_tokens": None, "max_sentences": None, **given} if device_type == "cuda" else given
    tokens, sentences = REFERENCE_BATCHES["cuda" if device_type == "cuda" else "cpu"]
    return {"max_tokens": tokens, "max_sentences": sentences, **given}


def model_dir_size(model_dir: str) -> dict:
    cfg = modeldir.read_config(model_dir)
    params = sum(_numel(s) for s in modeldir.tensor_shapes(cfg.arch).values())
    return {"params": params, "bytes": os.path.getsize(os.path.join(model_dir, modeldir.WEIGHTS))}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# MarianTokenizer's SentencePiece model, a fast tokenizer's single file, or M2M100/NLLB/mBART's spm
HF_TOKENIZER_FILES = ("source.spm", "tokenizer.json", "sentencepiece.bpe.model", "spm.model")


def _lang_token(tok, code: str) -> str | None:
    """The tokenizer's token for language `code`: __es__ (M2M100), >>es<< (Marian), es_XX
    (mBART), spa_Latn (NLLB, given as spa or spa_Latn), or the code itself."""
    def known(t):  # get_vocab() leaves out M2M100Tokenizer's language tokens
        i = tok.convert_tokens_to_ids(t)
        return i is not None and i != tok.unk_token_id

    for t in (f"__{code}__", f">>{code}<<", code):
        if known(t):
            return t
    special = sorted(t for t in tok.all_special_tokens if t.startswith(f"{code}_"))
    return special[0] if len(special) == 1 else None


class HFTeacher:
    """A local Hugging Face seq2seq dir (AutoModelForSeq2SeqLM: Marian, M2M100, NLLB, mBART...).

    Multilingual models get their language tokens from `set_languages` (the corpus'
    pair): the source language on the tokenizer (src_lang) and the target as the
    forced first token (forced_bos_token_id), or Marian's >>tgt<< source prefix
    where its vocabulary has one. transformers is optional: imported in load() only."""

    def __init__(self, hf_dir: str, beam: int = 4, device: str | None = None, batch_size: int = 32,
                 max_new_tokens: int = 256):
        if not os.path.isdir(hf_dir):
            raise TeacherError(f"{hf_dir}: Hugging Face model dir does not exist")
        # checked here, before any work: transformers fails on a missing tokenizer with
        # a bare TypeError, and only once the first shard is translated
        if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in HF_TOKENIZER_FILES):
            raise TeacherError(f"{hf_dir}: no tokenizer in the Hugging Face dir (none of "
                               f"{', '.join(HF_TOKENIZER_FILES)}); save it with tokenizer.save_pretrained(DIR)")
        self.dir, self.beam, self.batch_size, self.max_new_tokens = os.path.abspath(hf_dir), beam, batch_size, max_new_tokens
        self.device = torch.device(device or device_kind())
        self.name = f"hf: {self.dir} (beam {beam})"
        self.identity = {"type": "hf", "dir": dir_digest(self.dir), "beam": beam}
        self.engine = "transformers"
        self.langs: tuple[str, str] | None = None
        self.prefix, self.forced_bos = "", None
        self._model = None

    def set_languages(self, src: str, tgt: str) -> None:
        """The corpus' language pair; checked against the tokenizer at load()."""
        self.langs = (src, tgt)
        self.identity = {**self.identity, "langs": [src, tgt]}
        if self._model is not None:
            self._use_languages()

    def load(self):
        if self._model is not None:
            return
        try:
            from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        except ImportError:
            raise TeacherError("--teacher-hf needs transformers: pip install transformers") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(self.dir, local_files_only=True)
            self._model = AutoModelForSeq2SeqLM.from_pretrained(self.dir, local_files_only=True).to(self.device).eval()
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise TeacherError(f"{self.dir}: cannot load a seq2seq model and tokenizer "
                               f"({str(e).splitlines()[0]})") from None
        self.engine = f"transformers {self._model.config.model_type}"
        # generating past the position table is an index error inside torch, not a translation
        limit = getattr(self._model.config, "max_position_embeddings", None)
        if limit:
            self.max_new_tokens = min(self.max_new_tokens, limit - 2)
        if self.langs:
            self._use_languages()

    def _use_languages(self) -> None:
        src, tgt = self.langs
        tok = self._tok
        multilingual = hasattr(tok, "src_lang")  # M2M100, NLLB, mBART-50 tokenizers
        if multilingual:
            s, t = _lang_token(tok, src), _lang_token(tok, tgt)
            if not (s and t):
                raise TeacherError(f"{self.dir}: no language token for {src if not s else tgt!r} in the "
                                   f"tokenizer (e.g. {', '.join(sorted(tok.all_special_tokens)[:6])})")
            # M2M100Tokenizer takes the code ("es"), the others their token ("es_XX", "spa_Latn")
            tok.src_lang = src if hasattr(tok, "get_lang_id") else s
            self.forced_bos = tok.convert_tokens_to_ids(t)
        elif _lang_token(tok, tgt) == f">>{tgt}<<":  # a multi-target Marian model
            self.prefix = f">>{tgt}<< "

    def engine_label(self) -> str:
        return self.engine

    @torch.no_grad()
    def translate(self, lines: list[str], where: str = "") -> list[str]:
        self.load()
        order = sorted((i for i, x in enumerate(lines) if x.strip()), key=lambda i: len(lines[i]))
        out = [""] * len(lines)
        kw = {} if self.forced_bos is None else {"forced_bos_token_id": self.forced_bos}
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            enc = self._tok([self.prefix + lines[i] for i in idx], return_tensors="pt", padding=True,
                            truncation=True).to(self.device)
            gen = self._model.generate(**enc, num_beams=self.beam, max_new_tokens=self.max_new_tokens, **kw)
            for i, y in zip(idx, self._tok.batch_decode(gen, skip_special_tokens=True)):
                out[i] = " ".join(y.split())
        return out

    def size(self) -> dict:
        self.load()
        params = sum(p.numel() for p in self._model.parameters())
        files = [f for f in os.listdir(self.dir) if f.endswith((".safetensors", ".bin"))]
        return {"params": params, "bytes": sum(os.path.getsize(os.path.join(self.dir, f)) for f in files)}


# Lines a worker process needs before a pool pays: a worker takes whole batches (up to 1,536
# tokens on CPU, a few dozen sentences), and each one's start is a torch import and a model load
# (about 3 s on a 2-core EPYC), against 1.2x the speed of as many threads in one process.
WORKER_MIN_LINES = 64


def cpu_workers(world: int = 1) -> int:
    """One lean-decoder worker process per core of this rank's share (0 = one process)."""
    n = len(os.sched_getaffinity(0)) // max(world, 1)
    return n if n > 1 else 0


def workers_for(lines: int, workers: int) -> int:
    """At most `workers` processes for an input of `lines` known beforehand: none (0, one process
    with a thread per core) where fewer than two would get WORKER_MIN_LINES each."""
    n = min(workers, lines // WORKER_MIN_LINES)
    return n if n > 1 else 0


def make_teacher(*, cmd: str | None = None, hf_dir: str | None = None, model_dirs: list[str] | None = None,
                 beam: int = 4, engine: str = "auto", device: str | None = None, world: int = 1):
    given = [x for x in (cmd, hf_dir, model_dirs) if x]
    if len(given) != 1:
        raise TeacherError("give exactly one teacher: a command, a Hugging Face dir, or model dir(s)")
    if cmd:
        return CommandTeacher(cmd)
    if hf_dir:
        return HFTeacher(hf_dir, beam=beam, device=device)
    # the decoder's fastest configuration: on CPU the precision its `auto` measures (int8
    # where int8 products beat fp32, else fp32) and one worker process per core; fp16 on a GPU
    dev = torch.device(device or device_kind())
    return ModelTeacher(model_dirs, beam=beam, engine=engine, device=str(dev),
                        precision="fp16" if dev.type == "cuda" else "auto",
                        workers=0 if dev.type == "cuda" else cpu_workers(world))
