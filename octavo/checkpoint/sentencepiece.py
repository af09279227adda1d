"""SentencePiece vocabularies as ``tokenizers`` objects: a ``tokenizer.model``
file (folders of Llama-2/Mistral-era checkpoints without tokenizer.json) and
the "llama" vocabulary of GGUF files share one builder, since both are the
same list of (piece, score, type).

The result tokenizes as transformers' converted tokenizer does (its
``LlamaTokenizer`` built from a tokenizer.model): no normalizer, a
Metaspace pre-tokenizer that turns spaces into U+2581 and prepends one to
the first word only (SentencePiece's dummy prefix; none after a special
token), split=False; BPE models get merges derived from the vocabulary
(a pair merges into a piece of the vocabulary, the higher the piece's score
the earlier), with byte fallback; unigram models run as unigram. Decoding
undoes the U+2581s and the dummy prefix and reassembles byte pieces.

tokenizer.model is a protobuf message; the few fields needed are read with a
small wire-format reader here, so loading one needs neither the
``sentencepiece`` nor the ``protobuf`` package.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from octavo.checkpoint.bounds import (MAX_PIECE_CHARS, MAX_SENTENCEPIECE_BYTES, MAX_VOCAB, MAX_VOCAB_CHARS,
                                      read_bounded)

SPACE = "\u2581"
# SentencePiece piece types (sentencepiece_model.proto; GGUF token_type uses the same numbers).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_UNIGRAM, MODEL_BPE = 1, 2


@dataclass
class SpmVocab:
    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int = MODEL_BPE
    add_dummy_prefix: bool = True
    unk_id: Optional[int] = 0
    bos_id: Optional[int] = 1
    eos_id: Optional[int] = 2
    pad_id: Optional[int] = None

    def piece(self, index: Optional[int]) -> Optional[str]:
        return self.pieces[index] if index is not None and 0 <= index < len(self.pieces) else None


def build_tokenizer(vocab: SpmVocab, where: str) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes and decodes like ``vocab``'s
    model; ValueError naming ``where`` (its file) for a vocabulary out of bounds."""
    _check_bounds(vocab, where)
    if vocab.model_type == MODEL_BPE:
        ids = {piece: i for i, piece in enumerate(vocab.pieces)}
        model = models.BPE(vocab=ids, merges=_merges(vocab, ids), unk_token=vocab.piece(vocab.unk_id),
                           fuse_unk=True, byte_fallback=BYTE in vocab.types)
    elif vocab.model_type == MODEL_UNIGRAM:
        try:
            model = models.Unigram(list(zip(vocab.pieces, vocab.scores)), vocab.unk_id, BYTE in vocab.types)
        except Exception as exc:  # tokenizers raises plain Exception for a vocabulary it refuses
            raise ValueError(f"{where}: the unigram vocabulary is refused by the tokenizers library: {exc}") from None
    else:
        raise ValueError(f"{where}: SentencePiece model type {vocab.model_type} is not supported; supported: "
                         f"unigram ({MODEL_UNIGRAM}), bpe ({MODEL_BPE})")
    tok = Tokenizer(model)
    prepend = "first" if vocab.add_dummy_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=prepend, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    # Control pieces (<s>, </s>, chat markers) are special: matched whole in
    # the text, skipped when decoding with skip_special_tokens. User-defined
    # pieces are matched whole too but are ordinary text.
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, t in zip(vocab.pieces, vocab.types) if t == CONTROL])
    tok.add_tokens([AddedToken(p, special=False, normalized=False)
                    for p, t in zip(vocab.pieces, vocab.types) if t == USER_DEFINED])
    return tok


def _check_bounds(vocab: SpmVocab, where: str) -> None:
    if len(vocab.pieces) > MAX_VOCAB:
        raise ValueError(f"{where}: the vocabulary has {len(vocab.pieces)} pieces; at most {MAX_VOCAB} are read")
    longest = max(range(len(vocab.pieces)), key=lambda i: len(vocab.pieces[i]), default=None)
    if longest is not None and len(vocab.pieces[longest]) > MAX_PIECE_CHARS:
        raise ValueError(f"{where}: piece {longest} is {len(vocab.pieces[longest])} characters long; a piece is "
                         f"at most {MAX_PIECE_CHARS}")
    total = sum(map(len, vocab.pieces))
    if total > MAX_VOCAB_CHARS:
        raise ValueError(f"{where}: the pieces have {total} characters together; a vocabulary has at most "
                         f"{MAX_VOCAB_CHARS}")
    if vocab.model_type == MODEL_UNIGRAM and vocab.unk_id is not None and vocab.piece(vocab.unk_id) is None:
        raise ValueError(f"{where}: the unknown piece's id {vocab.unk_id} is not in the vocabulary of "
                         f"{len(vocab.pieces)} pieces")


def _merges(vocab: SpmVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces of the vocabulary,
    ranked by the whole piece's score (highest first): SentencePiece's BPE
    merges the adjacent pair whose union scores best."""
    ranked = []
    for index, (piece, score, kind) in enumerate(zip(vocab.pieces, vocab.scores, vocab.types)):
        if kind not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left = piece[:cut]
            if left in ids and piece[cut:] in ids:
                ranked.append((-score, index, cut, left, piece[cut:]))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


# ---- tokenizer.model ------------------------------------------------------------

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
# The wire type of each field read, per message: a file that stores one
# under another wire type is refused (read as it is, a varint where a
# piece's text belongs would be taken for a length and allocated).
_MODEL_FIELDS = {1: _BYTES, 2: _BYTES, 3: _BYTES}  # pieces, trainer_spec, normalizer_spec
_PIECE_FIELDS = {1: _BYTES, 2: _FIXED32, 3: _VARINT}  # piece, score, type
_TRAINER_FIELDS = {3: _VARINT, 40: _VARINT, 41: _VARINT, 42: _VARINT, 43: _VARINT}  # model_type, special ids
_NORMALIZER_FIELDS = {3: _VARINT}  # add_dummy_prefix


def read_model_file(path: str | Path) -> SpmVocab:
    """The vocabulary of a SentencePiece ``tokenizer.model``; ValueError naming
    the file and the field when it is not one, or declares more than it holds."""
    path = Path(path)
    data = read_bounded(path, MAX_SENTENCEPIECE_BYTES)
    try:
        return parse_model(data)
    except ValueError as exc:
        raise ValueError(f"{path} is not a SentencePiece model: {exc}") from None


def parse_model(data: bytes) -> SpmVocab:
    """The vocabulary of a tokenizer.model's bytes; ValueError saying what is wrong (without the file's name)."""
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    trainer: dict[int, int] = {}
    normalizer: dict[int, int] = {}
    for number, value in _fields(data, _MODEL_FIELDS, "ModelProto"):
        if number == 1:
            if len(pieces) == MAX_VOCAB:
                raise ValueError(f"it holds more than {MAX_VOCAB} pieces")
            piece = dict(_fields(value, _PIECE_FIELDS, f"piece {len(pieces)}"))
            pieces.append(_piece_text(piece.get(1, b""), len(pieces)))
            scores.append(struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0)
            types.append(_piece_type(piece.get(3, NORMAL), len(pieces) - 1))
        elif number == 2:
            trainer.update(_fields(value, _TRAINER_FIELDS, "trainer_spec"))
        elif number == 3:
            normalizer.update(_fields(value, _NORMALIZER_FIELDS, "normalizer_spec"))
    if not pieces:
        raise ValueError("it holds no pieces")

    def special(number: int, default: int) -> Optional[int]:
        value = _signed(trainer.get(number, default))
        return value if value >= 0 else None

    return SpmVocab(
        pieces, scores, types,
        model_type=int(trainer.get(3, MODEL_UNIGRAM)),
        add_dummy_prefix=bool(normalizer.get(3, 1)),
        unk_id=special(40, 0), bos_id=special(41, 1), eos_id=special(42, 2), pad_id=special(43, -1),
    )


def _piece_text(raw: bytes, index: int) -> str:
    # Checked in bytes before decoding: a character is at most 4 of them.
    if len(raw) > 4 * MAX_PIECE_CHARS:
        raise ValueError(f"piece {index} is {len(raw)} bytes long; a piece is at most {MAX_PIECE_CHARS} characters")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"piece {index} is not UTF-8 text") from None


def _piece_type(value: int, index: int) -> int:
    if not NORMAL <= value <= BYTE:
        raise ValueError(f"piece {index} has type {value}; SentencePiece piece types are {NORMAL} to {BYTE}")
    return value


def _fields(data: bytes, wire_types: dict[int, int], message: str) -> Iterator[tuple[int, Any]]:
    """(field number, value) of the fields of ``message`` named in
    ``wire_types`` (ints for varints, bytes for the others), each checked to
    be stored under its wire type; other fields are skipped."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(data, pos)
        elif wire == _BYTES:
            size, pos = _varint(data, pos)
            if size > len(data) - pos:
                raise ValueError(f"{message}'s field {number} declares {size} bytes; {len(data) - pos} are left")
            value, pos = data[pos:pos + size], pos + size
        elif wire in (_FIXED64, _FIXED32):
            width = 8 if wire == _FIXED64 else 4
            if width > len(data) - pos:
                raise ValueError(f"{message}'s field {number} runs past the end of the data")
            value, pos = data[pos:pos + width], pos + width
        else:
            raise ValueError(f"{message}'s field {number} has wire type {wire}, which protobuf does not define")
        if number in wire_types:
            if wire != wire_types[number]:
                raise ValueError(f"{message}'s field {number} has wire type {wire}; it is stored as "
                                 f"wire type {wire_types[number]}")
            yield number, value


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = 0
    for shift in range(0, 70, 7):  # a varint is at most 10 bytes (64 bits)
        if pos >= len(data):
            raise ValueError("a number runs past the end of the data")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & ((1 << 64) - 1), pos
    raise ValueError("a number is longer than 10 bytes")


def _signed(value: int) -> int:
    """An int32 stored as a 64-bit two's-complement varint (negative ids: "none")."""
    return value - (1 << 64) if value >= 1 << 63 else value
