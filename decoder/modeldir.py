"""The model-dir contract: the only thing training and decoding share.

    model/
      config.json        format_version, architecture, special ids, languages,
                         normaliser settings, provenance
      model.safetensors  weights, names in TENSOR_NAMES below (decoder/README.md)
      spm.model          joint SentencePiece model
      shortlist.safetensors  optional lexical shortlist, listed as files.shortlist
                         (read only when the decoder's `shortlist` switch is on)

Loading runs no code from the directory (safetensors, JSON), and every problem
is one `ModelDirError` whose message names the offending file.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field

from . import durable

FORMAT_VERSION = 1
CONFIG, WEIGHTS, SPM = "config.json", "model.safetensors", "spm.model"
SHORTLIST = "shortlist.safetensors"
SHORTLIST_TENSORS = ("offsets", "ids", "frequent")


class ModelDirError(Exception):
    """A model dir that cannot be used; str(e) is one line naming the file."""


class NoShortlist(ModelDirError):
    """The shortlist switch is on for a model dir that lists no shortlist: the option is at fault
    as much as the dir, so the CLI names it."""


# -- resource bounds ---------------------------------------------------------------------
# A config.json is a few KB; reading more than this is a wrong file (a link to
# /dev/zero, a weights file renamed), never a config.
MAX_CONFIG_BYTES = 1 << 20
# The largest size of each kind that a real model has, with room to spare (the
# largest public models: vocabularies of 256k, d_model 16,384, FFN 53,248, 128
# heads, 126 layers, 32k-128k positions). A config beyond them is a typo or an
# attack: accepted, max_positions 1e9 alone asks for a 512 GB position table and
# a 256 GB per-line read cap (textio.line_cap). docs/reliability.md lists them.
MAX_VOCAB = 1 << 20          # 1,048,576 pieces
MAX_D_MODEL = 1 << 14        # 16,384
MAX_FFN_DIM = 1 << 17        # 131,072
MAX_HEADS = 1 << 10          # 1,024
MAX_LAYERS = 1 << 10         # 1,024 per stack
MAX_POSITIONS = 1 << 16      # 65,536 tokens: a line cap of 16 MiB, a position table of at most 4 GiB
# spm.model is read whole by SentencePiece; a 256k-piece model is about 5 MB
MAX_SPM_BYTES = 64 << 20


def read_json(path: str, limit: int = MAX_CONFIG_BYTES, what: str = "JSON file"):
    """The parsed JSON of a regular file of at most `limit` bytes, or a ModelDirError naming it.

    Every way a JSON file can fail is one line here: not a regular file (a FIFO
    would block the open, /dev/zero never ends), too large, not UTF-8, invalid,
    nested past the parser's recursion limit, an integer past Python's 4,300-digit
    conversion limit."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ModelDirError(f"{path}: not a regular file")
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as e:  # a directory, no permission, a dangling link, an I/O error
        raise ModelDirError(f"{path}: unreadable ({e.strerror or e})") from None
    if len(data) > limit:
        raise ModelDirError(f"{path}: larger than {limit:,} bytes, not a {what}")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelDirError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ModelDirError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, and int() past sys.get_int_max_str_digits()
        raise ModelDirError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None


@dataclass(frozen=True)
class Arch:
    vocab_size: int
    d_model: int
    n_heads: int
    ffn_dim: int
    encoder_layers: int
    decoder_layers: int
    max_positions: int = 1024
    activation: str = "relu"
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch
    bos_id: int = 0
    pad_id: int = 1
    eos_id: int = 2
    unk_id: int = 3
    decoder_start_id: int = 2  # fairseq/M2M100: the decoder starts from </s>
    src_lang: str = "en"
    tgt_lang: str = "es"
    normaliser: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    extra_files: dict = field(default_factory=dict)
    shortlist: str | None = None  # file name in the model dir (read_shortlist)

    def to_json(self) -> dict:
        a = self.arch
        return {
            "format_version": FORMAT_VERSION,
            "architecture": {
                "type": "transformer-prenorm",  # M2M100 layout, see decoder/README.md
                "vocab_size": a.vocab_size, "d_model": a.d_model, "n_heads": a.n_heads,
                "ffn_dim": a.ffn_dim, "encoder_layers": a.encoder_layers,
                "decoder_layers": a.decoder_layers, "max_positions": a.max_positions,
                "activation": a.activation, "tie_embeddings": a.tie_embeddings,
                "layer_norm_eps": a.layer_norm_eps,
                "positions": "sinusoidal-fairseq", "scale_embedding": True,
            },
            "special_ids": {"bos": self.bos_id, "pad": self.pad_id, "eos": self.eos_id,
                            "unk": self.unk_id, "decoder_start": self.decoder_start_id},
            "languages": {"src": self.src_lang, "tgt": self.tgt_lang},
            "normaliser": self.normaliser,
            "provenance": self.provenance,
            "files": {"weights": WEIGHTS, "spm": SPM, **self.extra_files,
                      **({"shortlist": self.shortlist} if self.shortlist else {})},
        }

    @classmethod
    def from_json(cls, d: dict, where: str = CONFIG) -> "ModelConfig":
        """The config of a parsed config.json, checked against SCHEMA first (ModelDirError)."""
        check_config(d, where)
        a, s, files = d["architecture"], d["special_ids"], d.get("files", {})
        arch = Arch(**{k: a[k] for k in (
            "vocab_size", "d_model", "n_heads", "ffn_dim", "encoder_layers", "decoder_layers",
            "max_positions", "activation", "tie_embeddings")}, layer_norm_eps=float(a["layer_norm_eps"]))
        return cls(arch=arch, bos_id=s["bos"], pad_id=s["pad"], eos_id=s["eos"],
                   unk_id=s["unk"], decoder_start_id=s["decoder_start"],
                   src_lang=d["languages"]["src"], tgt_lang=d["languages"]["tgt"],
                   normaliser=d.get("normaliser", {}), provenance=d.get("provenance", {}),
                   extra_files={k: v for k, v in files.items() if k not in ("weights", "spm", "shortlist")},
                   shortlist=files.get("shortlist"))


# -- config.json schema ----------------------------------------------------------------
# Every value this decoder reads, with the values it implements. A value outside
# them must fail here, at load time: accepted, it decodes to silently wrong output
# (learned positions read as sinusoidal) or fails mid-stream after input was read.

@dataclass(frozen=True)
class Field:
    kind: type                 # int, float, bool, str or dict (JSON types; bool is not an int here)
    ok: object = None          # value -> bool, the range or set of values implemented
    want: str = ""             # that range in words, for the error message
    required: bool = True


def _ints(lo: int, hi: int | None = None) -> Field:
    if hi is None:
        return Field(int, lambda v: v >= lo, f">= {lo}")
    return Field(int, lambda v: lo <= v <= hi, f"in [{lo}, {hi:,}]")


def _one_of(*values) -> Field:
    names = [json.dumps(v) for v in values]
    return Field(type(values[0]), lambda v: v in values, names[0] if len(names) == 1 else "one of " + ", ".join(names))


# A language code becomes part of file names (student.data's train.<lang>): letters, digits,
# '-' and '_', at most 35 characters, as BCP 47 tags are. "e/n" or "/../x" would be a path.
LANGUAGE_CODE = re.compile(r"[A-Za-z0-9_-]{1,35}")
LANGUAGE_WANT = "a language code (letters, digits, '-', '_', at most 35 characters)"


# A name the user gives that becomes one folder (a corpus under prepared/, a run under
# --runs-dir): no '/', not '.' or '..' nor hidden, and short enough for any file system.
FOLDER_NAME = re.compile(r"(?!\.)[A-Za-z0-9_.-]{1,100}")
FOLDER_WANT = "a folder name (letters, digits, '.', '-', '_', at most 100 characters, not starting with '.')"


def folder_name_error(name) -> str | None:
    """Why `name` is no folder name, in words, or None."""
    if isinstance(name, str) and FOLDER_NAME.fullmatch(name):
        return None
    return f"must be {FOLDER_WANT}, got {_show(name)}"


def language_error(code) -> str | None:
    """Why `code` is no language code, in words, or None."""
    if isinstance(code, str) and LANGUAGE_CODE.fullmatch(code):
        return None
    return f"must be {LANGUAGE_WANT}, got {_show(code)}"


def _language(required: bool = True) -> Field:
    return Field(str, lambda v: language_error(v) is None, LANGUAGE_WANT, required)


def _file_name(default: str) -> Field:
    return Field(str, lambda v: v == default, f'"{default}" (the decoder reads no other name)', required=False)


_MOSES_FLAGS = ("penn", "norm_quote_commas", "norm_numbers", "pre_replace_unicode_punct",
                "post_remove_control_chars")  # sacremoses.MosesPunctNormalizer's switches
SPECIAL_IDS = ("bos", "pad", "eos", "unk", "decoder_start")

SCHEMA: dict[str, dict[str, Field]] = {
    "architecture": {
        "type": _one_of("transformer-prenorm"),
        "vocab_size": _ints(1, MAX_VOCAB), "d_model": _ints(1, MAX_D_MODEL), "n_heads": _ints(1, MAX_HEADS),
        "ffn_dim": _ints(1, MAX_FFN_DIM), "encoder_layers": _ints(1, MAX_LAYERS),
        "decoder_layers": _ints(1, MAX_LAYERS),
        "max_positions": _ints(2, MAX_POSITIONS),  # at least one token plus </s>
        "activation": _one_of("relu", "gelu"),
        "tie_embeddings": Field(bool),
        "layer_norm_eps": Field(float, lambda v: v > 0, "> 0"),
        "positions": _one_of("sinusoidal-fairseq"),
        "scale_embedding": _one_of(True),
    },
    "special_ids": {k: _ints(0) for k in SPECIAL_IDS},  # and < vocab_size: check_config
    "languages": {"src": _language(), "tgt": _language()},
    # {} = no normaliser; else a MosesPunctNormalizer (decoder/pipeline.py make_normaliser)
    "normaliser": {"type": _one_of("moses-punct"), "src_lang": _language(False), "tgt_lang": _language(False),
                   **{k: Field(bool, required=False) for k in _MOSES_FLAGS}},
    "files": {"weights": _file_name(WEIGHTS), "spm": _file_name(SPM)},  # shortlist: check_config
}
OPTIONAL_SECTIONS = ("normaliser", "provenance", "files")  # other top-level keys are left alone


def _show(v, width: int = 40) -> str:
    """A config value for an error line: JSON, cut to `width` characters (a value may be
    a 4,000-digit integer)."""
    text = json.dumps(v)
    return text if len(text) <= width else f"{text[:width]}... ({len(text):,} characters)"


def _type_error(v, kind: type) -> str | None:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
    if kind is float:
        good = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    elif kind is int:
        good = isinstance(v, int) and not isinstance(v, bool)
    else:
        good = isinstance(v, kind)
    return None if good else f"must be {names[kind]}, got {_show(v)}"


def check_config(d: dict, where: str = CONFIG) -> None:
    """Raise ModelDirError naming `where` and the key of the first value outside SCHEMA."""
    def bad(key: str, why: str):
        raise ModelDirError(f"{where}: {key} {why}")

    for section, fields in SCHEMA.items():
        if section not in d:
            if section in OPTIONAL_SECTIONS:
                continue
            raise ModelDirError(f"{where}: missing or malformed field {section!r}")
        _check_section(section, d[section], fields, bad)
    if not isinstance(d.get("provenance", {}), dict):
        bad("provenance", "must be an object")
    a, ids = d["architecture"], d["special_ids"]
    if a["d_model"] % a["n_heads"]:
        bad("architecture.n_heads", f"must divide d_model {a['d_model']}, got {a['n_heads']}")
    for k in SPECIAL_IDS:
        if ids[k] >= a["vocab_size"]:
            bad(f"special_ids.{k}", f"must be below vocab_size {a['vocab_size']}, got {_show(ids[k])}")
    files = d.get("files", {})
    shortlist = files.get("shortlist")
    # a bare name: the config must not point outside its own directory
    if shortlist is not None and (not isinstance(shortlist, str) or shortlist in ("", ".", "..")
                                  or "/" in shortlist or os.sep in shortlist):
        bad("files.shortlist", f"must be a file name in the model dir, got {_show(shortlist)}")
    for k, v in files.items():
        if not isinstance(v, str):
            bad(f"files.{k}", f"must be a file name, got {_show(v)}")


def _check_section(section: str, sec, fields: dict[str, Field], bad) -> None:
    if not isinstance(sec, dict):
        bad(section, f"must be an object, got {_show(sec, 80)}")
    if section == "normaliser" and not sec:
        return  # no normaliser
    extra = sorted(set(sec) - set(fields)) if section != "files" else []  # files may list more
    if extra:
        bad(f"{section}.{extra[0]}", f"is not a key this decoder implements (known: {', '.join(fields)})")
    for k, f in fields.items():
        if k not in sec:
            if f.required:
                bad(f"{section}.{k}", "is missing")
            continue
        why = _type_error(sec[k], f.kind)
        if why is None and f.ok is not None and not f.ok(sec[k]):
            why = f"must be {f.want}, got {_show(sec[k])}"
        if why:
            bad(f"{section}.{k}", why)


def tensor_shapes(a: Arch) -> dict[str, tuple[int, ...]]:
    """Every tensor of model.safetensors and its shape (the table in decoder/README.md).

    Names follow Hugging Face M2M100 without the leading "model.", so the HF
    converter is a rename-free copy and the CTranslate2 converter a fixed map.
    """
    d, f = a.d_model, a.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"shared.weight": (a.vocab_size, d)}
    if not a.tie_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, d)

    def attn(p):
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}.{n}.weight"] = (d, d)
            shapes[f"{p}.{n}.bias"] = (d,)

    def norm(p):
        shapes[f"{p}.weight"] = (d,)
        shapes[f"{p}.bias"] = (d,)

    def ffn(p):
        shapes[f"{p}.fc1.weight"] = (f, d)
        shapes[f"{p}.fc1.bias"] = (f,)
        shapes[f"{p}.fc2.weight"] = (d, f)
        shapes[f"{p}.fc2.bias"] = (d,)

    for i in range(a.encoder_layers):
        p = f"encoder.layers.{i}"
        attn(f"{p}.self_attn"); norm(f"{p}.self_attn_layer_norm")
        ffn(p); norm(f"{p}.final_layer_norm")
    norm("encoder.layer_norm")
    for i in range(a.decoder_layers):
        p = f"decoder.layers.{i}"
        attn(f"{p}.self_attn"); norm(f"{p}.self_attn_layer_norm")
        attn(f"{p}.encoder_attn"); norm(f"{p}.encoder_attn_layer_norm")
        ffn(p); norm(f"{p}.final_layer_norm")
    norm("decoder.layer_norm")
    return shapes


def read_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, CONFIG)
    if not os.path.isdir(model_dir):
        raise ModelDirError(f"{model_dir}: model dir does not exist")
    if not os.path.lexists(path):
        raise ModelDirError(f"{path}: missing file")
    d = read_json(path, what="config.json")
    if not isinstance(d, dict):
        raise ModelDirError(f"{path}: expected a JSON object")
    v = d.get("format_version")
    if v != FORMAT_VERSION:
        raise ModelDirError(f"{path}: unknown format_version {_show(v)} (this decoder reads {FORMAT_VERSION})")
    return ModelConfig.from_json(d, where=path)


def check_files(model_dir: str, cfg: ModelConfig, shortlist: bool = True) -> None:
    """ModelDirError for the first file the dir needs that is not there: the weights, the
    SentencePiece model and (`shortlist`) the shortlist its config lists. A command that runs
    for an hour finds out at its start, not when its first shortlist row loads."""
    for name, listed in ((WEIGHTS, None), (SPM, None), (cfg.shortlist if shortlist else None, "files.shortlist")):
        if name and not os.path.lexists(path := os.path.join(model_dir, name)):
            raise ModelDirError(f"{path}: missing file" + (f" (listed as {listed} in {CONFIG})" if listed else ""))


def load(model_dir: str, device: str = "cpu"):
    """(config, {name: tensor}, spm_path) of a validated model dir."""
    import torch  # noqa: F401  (safetensors.torch needs it)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = read_config(model_dir)
    wpath, spath = os.path.join(model_dir, WEIGHTS), os.path.join(model_dir, SPM)
    _regular_file(wpath)
    spm_file(spath)  # SentencePiece reads the whole file into memory
    try:
        weights = load_file(wpath, device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError, MemoryError) as e:
        if is_allocation_failure(e):
            raise ModelDirError(f"{wpath}: not enough memory to load the weights ({first_line(e)})") from None
        raise ModelDirError(f"{wpath}: unreadable safetensors ({first_line(e)})") from None
    expected = tensor_shapes(cfg.arch)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelDirError(f"{wpath}: missing tensor {missing[0]} ({len(missing)} missing)")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelDirError(f"{wpath}: unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected)")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelDirError(f"{wpath}: shape mismatch for {name}: "
                                f"{tuple(weights[name].shape)} in file, {shape} from {CONFIG}")
    check_weights(weights, wpath)
    read_spm(spath, cfg.arch.vocab_size)
    return cfg, weights, spath


def read_spm(spath: str, vocab_size: int):
    """The SentencePiece model of a model dir, checked against its config's vocabulary, or a
    ModelDirError naming the file (random bytes, a size past MAX_SPM_BYTES, another vocabulary)."""
    spm_file(spath)
    try:
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=spath)
    except Exception as e:  # sentencepiece raises OSError/RuntimeError variously
        raise ModelDirError(f"{spath}: unreadable SentencePiece model ({str(e).splitlines()[0]})") from None
    if sp.get_piece_size() != vocab_size:
        raise ModelDirError(f"{spath}: vocabulary has {sp.get_piece_size()} pieces, {CONFIG} says {vocab_size}")
    return sp


def _regular_file(p: str, limit: int | None = None, what: str = "") -> None:
    """ModelDirError unless p is a regular file (of at most `limit` bytes): a FIFO or a
    device (a link to /dev/zero) would block or never end."""
    if not os.path.lexists(p):
        raise ModelDirError(f"{p}: missing file")
    if not os.path.isfile(p):
        raise ModelDirError(f"{p}: not a regular file")
    if limit is not None and os.path.getsize(p) > limit:
        raise ModelDirError(f"{p}: larger than {limit:,} bytes, not a {what}")


def spm_file(p: str) -> str:
    """`p`, checked as a SentencePiece model file to read by name (from a checkpoint, a
    config, a model dir): a regular file of at most MAX_SPM_BYTES; else ModelDirError."""
    _regular_file(p, MAX_SPM_BYTES, "SentencePiece model")
    return p


# The files a model dir of ours holds; an output dir holding anything else is not one
# to replace (it may be a run dir, or the user's own).
MODEL_FILES = frozenset((CONFIG, WEIGHTS, SPM, SHORTLIST))


def replace_error(out: str) -> str | None:
    """Why writing a model dir at `out` would delete or overwrite what no command of
    the kit wrote (it exists and is not a dir, or holds more than a model dir's files),
    in words, or None: it is new, empty, or a model dir of ours."""
    if not os.path.lexists(out):
        return None
    if os.path.islink(out) or not os.path.isdir(out):
        return "exists and is not a directory"
    try:
        extra = sorted(set(os.listdir(out)) - MODEL_FILES)
    except OSError as e:
        return (e.strerror or str(e)).lower()
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        return f"exists and holds {extra[0]!r}{more}, not only a model dir's files"
    return None


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def is_allocation_failure(e: BaseException) -> bool:
    """Whether `e` is an allocation that failed (torch raises RuntimeError on CPU,
    torch.OutOfMemoryError, a RuntimeError too, on CUDA), not a bad file."""
    text = str(e).lower()
    said = any(x in text for x in ("can't allocate memory", "not enough memory", "out of memory"))
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and said)


def check_weights(weights: dict, where: str) -> None:
    """Every tensor fp32 (what the exporter writes) and finite, or a ModelDirError naming it.

    An int64 embedding or a NaN weight loads without complaint and decodes every
    line to an empty or garbage output, exit 0: the worst failure there is."""
    import torch

    for name, t in weights.items():
        if t.dtype != torch.float32:
            raise ModelDirError(f"{where}: tensor {name} is {str(t.dtype).removeprefix('torch.')}, "
                                f"expected float32")
    for name, t in weights.items():
        # any NaN or inf makes the sum NaN or inf: one cheap reduction (isfinite().all()
        # took 20x longer, 0.36 s for a 32000 x 1024 embedding); an overflowing sum of
        # finite values is told apart by the exact test
        if not bool(t.sum().isfinite()) and not bool(torch.isfinite(t).all()):
            raise ModelDirError(f"{where}: tensor {name} holds NaN or infinite values")


def has_shortlist(model_dir: str, cfg: ModelConfig) -> bool:
    """Whether the dir lists a shortlist and holds its file: where the decoder and the
    container run it by default (a listed file may be left out, as an image's copy was)."""
    return bool(cfg.shortlist) and os.path.isfile(os.path.join(model_dir, cfg.shortlist))


def read_shortlist(model_dir: str, cfg: ModelConfig):
    """(offsets (V+1,), ids (nnz,), frequent (N,)), int64, of the model dir's shortlist.

    CSR layout: the candidate target ids of source token s are
    ids[offsets[s]:offsets[s+1]]; `frequent` are allowed in every batch.
    Validated here so a bad file fails at load time, not mid-batch."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if cfg.shortlist is None:
        raise NoShortlist(f"{os.path.join(model_dir, CONFIG)}: no shortlist listed (files.shortlist); "
                            f"build one with python -m student.shortlist")
    path = os.path.join(model_dir, cfg.shortlist)
    if not os.path.lexists(path):
        raise ModelDirError(f"{path}: missing file (listed as files.shortlist in {CONFIG})")
    _regular_file(path)
    try:
        t = load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ModelDirError(f"{path}: unreadable safetensors ({str(e).splitlines()[0]})") from None
    return check_shortlist(t, cfg.arch.vocab_size, path)


def check_shortlist(t: dict, vocab_size: int, where: str):
    """The (offsets, ids, frequent) of shortlist tensors `t`, int64, or a ModelDirError naming `where`."""
    import torch

    for name in SHORTLIST_TENSORS:
        if name not in t:
            raise ModelDirError(f"{where}: missing tensor {name}")
        x = t[name]
        if x.dim() != 1 or x.dtype not in (torch.int32, torch.int64):
            raise ModelDirError(f"{where}: {name} must be a 1-d int32/int64 tensor, "
                                f"got {x.dtype} {tuple(x.shape)}")
    unexpected = sorted(set(t) - set(SHORTLIST_TENSORS))
    if unexpected:
        raise ModelDirError(f"{where}: unexpected tensor {unexpected[0]}")
    offsets, ids, frequent = (t[n].long() for n in SHORTLIST_TENSORS)
    V = vocab_size
    if offsets.numel() != V + 1:
        raise ModelDirError(f"{where}: offsets has {offsets.numel()} entries, expected vocab_size + 1 = {V + 1}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets[1:] < offsets[:-1]).any()):
        raise ModelDirError(f"{where}: offsets must rise from 0 to len(ids) = {ids.numel()}")
    for name, x in (("ids", ids), ("frequent", frequent)):
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= V):
            raise ModelDirError(f"{where}: {name} holds token ids outside [0, {V}) "
                                f"(min {int(x.min())}, max {int(x.max())})")
    return offsets, ids, frequent


def write_shortlist(model_dir: str, offsets, ids, frequent, metadata: dict | None = None) -> str:
    """Write shortlist.safetensors into a model dir and list it in config.json.

    The tensors are checked before anything is written; config.json is rewritten
    with only files.shortlist changed, so fields this version does not know survive."""
    import torch
    from safetensors.torch import save

    cfg = read_config(model_dir)
    path = os.path.join(model_dir, SHORTLIST)
    tensors = {n: torch.as_tensor(x) for n, x in zip(SHORTLIST_TENSORS, (offsets, ids, frequent))}
    check_shortlist(tensors, cfg.arch.vocab_size, path)  # before anything is written
    # int32: half the bytes, and vocabularies stay far below 2**31
    tensors = {n: x.to(torch.int32).contiguous() for n, x in tensors.items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    cpath = os.path.join(model_dir, CONFIG)
    d = read_json(cpath)
    d.setdefault("files", {})["shortlist"] = SHORTLIST
    # both files or neither; a link inside the dir is replaced, never followed out of it
    with durable.undone_on_failure(path, cpath):
        durable.atomic_write(path, lambda tmp: durable.write_bytes(tmp, save(tensors, metadata=meta)), follow=False)
        durable.atomic_write(cpath, lambda tmp: durable.write_bytes(tmp, durable.json_bytes(d)), follow=False)
    return path


# config.json "normaliser" {"type": "moses-punct", ...}: these keys are the keyword
# arguments of sacremoses.MosesPunctNormalizer; training and decoding both build it
# from here, so a key a config leaves out takes sacremoses' default on both sides
MOSES_KWARGS = ("penn", "norm_quote_commas", "norm_numbers", "pre_replace_unicode_punct",
                "post_remove_control_chars")


def moses_options(normaliser: dict) -> dict:
    """The MosesPunctNormalizer keyword arguments (lang aside) a normaliser entry gives."""
    return {k: bool(normaliser[k]) for k in MOSES_KWARGS if k in normaliser}


def sinusoidal_table(n_positions: int, dim: int, pad_id: int) -> "torch.Tensor":
    """fairseq positions as the contract's "sinusoidal-fairseq" fixes them: sin half then
    cos half, row pad_id zero; position p of a sentence is row pad_id + 1 + p."""
    import math

    import torch
    half = dim // 2
    w = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000.0) / (half - 1)))
    ang = torch.arange(n_positions, dtype=torch.float)[:, None] * w[None]  # (n, half)
    table = torch.cat([torch.sin(ang), torch.cos(ang)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(n_positions, 1)], dim=1)
    table[pad_id] = 0
    return table  # (n_positions, dim)
