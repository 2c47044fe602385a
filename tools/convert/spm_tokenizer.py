"""Our SentencePiece model as a Hugging Face fast tokenizer that encodes like decoder/pipeline.py
`Text` (SentencePiece ids, then </s>), so `AutoTokenizer.from_pretrained(dir)` works offline.

The `tokenizers` pipeline follows the model's protobuf (the normaliser's
precompiled charsmap, dummy prefix, byte fallback); reading it with the
protobuf package would add a dependency the kit does not have, so the few
fields used are taken from the wire format here (spm's
sentencepiece_model.proto: field numbers below).
"""
from __future__ import annotations

import struct
from types import SimpleNamespace

# sentencepiece_model.proto field numbers
_PIECES, _TRAINER, _NORMALIZER = 1, 2, 3
_PIECE, _SCORE, _TYPE = 1, 2, 3
_MODEL_TYPE, _BYTE_FALLBACK, _UNK_ID, _UNK_PIECE = 3, 35, 40, 45
_CHARSMAP, _DUMMY_PREFIX, _EXTRA_WS, _ESCAPE_WS = 2, 3, 4, 5
UNIGRAM = 1


def _varint(b: bytes, i: int) -> tuple[int, int]:
    x = shift = 0
    while True:
        c = b[i]
        i += 1
        x |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return x, i


def _fields(b: bytes):
    """(field number, value) of one message; value: int (varint), bytes (length-delimited), float (fixed32)."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            v, i = b[i:i + n], i + n
        elif wire == 5:
            v, i = struct.unpack("<f", b[i:i + 4])[0], i + 4
        elif wire == 1:
            v, i = b[i:i + 8], i + 8
        else:
            raise ValueError(f"SentencePiece model: unsupported protobuf wire type {wire}")
        yield num, v


def read_spm_proto(path: str) -> SimpleNamespace:
    """The ModelProto fields transformers' converter reads, with proto2's defaults."""
    with open(path, "rb") as fh:
        data = fh.read()
    pieces, trainer, norm = [], {}, {}
    for num, v in _fields(data):
        if num == _PIECES:
            f = dict(_fields(v))
            pieces.append(SimpleNamespace(piece=f[_PIECE].decode("utf-8"), score=f.get(_SCORE, 0.0),
                                          type=f.get(_TYPE, 1)))
        elif num == _TRAINER:
            trainer = dict(_fields(v))
        elif num == _NORMALIZER:
            norm = dict(_fields(v))
    return SimpleNamespace(
        pieces=pieces,
        trainer_spec=SimpleNamespace(model_type=trainer.get(_MODEL_TYPE, UNIGRAM),
                                     byte_fallback=bool(trainer.get(_BYTE_FALLBACK, 0)),
                                     unk_id=trainer.get(_UNK_ID, 0),
                                     unk_piece=trainer.get(_UNK_PIECE, b"<unk>").decode("utf-8")),
        normalizer_spec=SimpleNamespace(precompiled_charsmap=norm.get(_CHARSMAP, b""),
                                        add_dummy_prefix=bool(norm.get(_DUMMY_PREFIX, 1)),
                                        remove_extra_whitespaces=bool(norm.get(_EXTRA_WS, 1)),
                                        escape_whitespaces=bool(norm.get(_ESCAPE_WS, 1))))


def spm_pipeline(proto: SimpleNamespace):
    """A `tokenizers.Tokenizer` that splits as SentencePieceProcessor.encode does (unigram models,
    SentencePiece's normaliser order: charsmap, extra spaces, escaping, dummy prefix)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    t, n = proto.trainer_spec, proto.normalizer_spec
    tok = Tokenizer(Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=t.unk_id,
                            byte_fallback=t.byte_fallback))
    steps = [normalizers.Precompiled(n.precompiled_charsmap)] if n.precompiled_charsmap else []
    if n.remove_extra_whitespaces:  # spaces only: SentencePiece leaves other whitespace alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if n.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    if n.add_dummy_prefix:
        # here, not in Metaspace: its "first" scheme skips the prefix once the normaliser has
        # stripped leading spaces (the text no longer starts at offset 0)
        steps.append(normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    steps = [decoders.Replace("\u2581", " ")] + ([decoders.ByteFallback()] if t.byte_fallback else [])
    steps += [decoders.Fuse()] + ([decoders.Strip(content=" ", left=1)] if n.add_dummy_prefix else [])
    tok.decoder = decoders.Sequence(steps)
    return tok


def hf_tokenizer(spm_path: str, bos_id: int, pad_id: int, eos_id: int, unk_id: int, max_length: int):
    """PreTrainedTokenizerFast: SentencePiece ids of the text, then </s> (no <s>), pads with <pad>."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    proto = read_spm_proto(spm_path)
    if proto.trainer_spec.model_type != UNIGRAM:
        raise ValueError(f"{spm_path}: a SentencePiece model of type {proto.trainer_spec.model_type}; "
                         f"the HF tokenizer is built for unigram models (what student.data trains)")
    tok = spm_pipeline(proto)
    piece = [p.piece for p in proto.pieces]
    tok.post_processor = TemplateProcessing(single=f"$A {piece[eos_id]}", pair=f"$A $B {piece[eos_id]}",
                                            special_tokens=[(piece[eos_id], eos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=piece[bos_id], eos_token=piece[eos_id],
                                   pad_token=piece[pad_id], unk_token=piece[unk_id],
                                   padding_side="right", model_max_length=max_length)
