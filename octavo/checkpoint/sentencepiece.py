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
from typing import Iterator, Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

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


def build_tokenizer(vocab: SpmVocab) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes and decodes like ``vocab``'s model."""
    if vocab.model_type == MODEL_BPE:
        ids = {piece: i for i, piece in enumerate(vocab.pieces)}
        model = models.BPE(vocab=ids, merges=_merges(vocab, ids), unk_token=vocab.piece(vocab.unk_id),
                           fuse_unk=True, byte_fallback=BYTE in vocab.types)
    elif vocab.model_type == MODEL_UNIGRAM:
        model = models.Unigram(list(zip(vocab.pieces, vocab.scores)), vocab.unk_id, BYTE in vocab.types)
    else:
        raise ValueError(f"SentencePiece model type {vocab.model_type} is not supported; supported: "
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


def _merges(vocab: SpmVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces of the vocabulary,
    ranked by the whole piece's score (highest first): SentencePiece's BPE
    merges the adjacent pair whose union scores best."""
    ranked = []
    for index, (piece, score, kind) in enumerate(zip(vocab.pieces, vocab.scores, vocab.types)):
        if kind not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-score, index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


# ---- tokenizer.model ------------------------------------------------------------


def read_model_file(path: str | Path) -> SpmVocab:
    """The vocabulary of a SentencePiece ``tokenizer.model``; ValueError when it is not one."""
    data = Path(path).read_bytes()
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    trainer: dict[int, int] = {}
    normalizer: dict[int, object] = {}
    try:
        for number, value in _fields(data):
            if number == 1 and isinstance(value, bytes):  # ModelProto.pieces
                piece = dict(_fields(value))
                pieces.append(bytes(piece.get(1, b"")).decode("utf-8"))
                scores.append(struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0)
                types.append(int(piece.get(3, NORMAL)))
            elif number == 2 and isinstance(value, bytes):  # trainer_spec
                trainer.update((k, v) for k, v in _fields(value) if isinstance(v, int))
            elif number == 3 and isinstance(value, bytes):  # normalizer_spec
                normalizer.update(_fields(value))
    except (IndexError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a SentencePiece model: {exc}") from None
    if not pieces:
        raise ValueError(f"{path} is not a SentencePiece model: it holds no pieces")

    def special(number: int, default: int) -> Optional[int]:
        value = _signed(trainer.get(number, default))
        return value if value >= 0 else None

    return SpmVocab(
        pieces, scores, types,
        model_type=int(trainer.get(3, MODEL_UNIGRAM)),
        add_dummy_prefix=bool(normalizer.get(3, 1)),
        unk_id=special(40, 0), bos_id=special(41, 1), eos_id=special(42, 2), pad_id=special(43, -1),
    )


def _fields(data: bytes) -> Iterator[tuple[int, object]]:
    """(field number, value) of a protobuf message: ints for varints, bytes
    for length-delimited fields and for fixed32/fixed64 (raw)."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise ValueError("a field runs past the end of the data")
            yield number, data[pos:pos + size]
            pos += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield number, data[pos:pos + width]
            pos += width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _signed(value: int) -> int:
    """An int32 stored as a 64-bit two's-complement varint (negative ids: "none")."""
    return value - (1 << 64) if value >= 1 << 63 else value
