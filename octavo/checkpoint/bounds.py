"""The limits an untrusted model file is held to before anything it declares
is allocated: each one far above what any released model needs, and low
enough that a file at the limit still loads in seconds and in memory the
size of its own tensors. Every reader of a checkpoint file checks against
these and its own file's size, and says which field broke which limit."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Decoder layers: the deepest released decoders have about 130.
MAX_LAYERS = 1024
# Positions a model may serve: the longest released context is 10M tokens.
MAX_CONTEXT = 1 << 24
# Rope scaling factors: released models stretch their trained context tens of times at most.
MAX_ROPE_FACTOR = 1024.0
# Tokens of a vocabulary: the largest released ones have about 260k.
MAX_VOCAB = 1 << 20
# One SentencePiece piece, in characters. Pieces are trained at most 16
# long by default; deriving a BPE vocabulary's merges tries every split of
# every piece, so the work grows with the square of a piece's length.
MAX_PIECE_CHARS = 256
# All pieces of one SentencePiece vocabulary together, in characters: the
# splits tried are at most this many (at the bound, 16k pieces of 256
# characters, deriving the merges took 7 s on a busy shared core).
MAX_VOCAB_CHARS = 1 << 22
# Elements of one GGUF metadata array: the arrays read hold a value per token
# (tokens, scores, types) or per merge, and each element becomes a Python
# object, 8 bytes or more however few it takes in the file.
MAX_METADATA_ARRAY = MAX_VOCAB
# One GGUF metadata string (the longest, a chat template, is tens of kilobytes).
MAX_METADATA_STRING = 16 << 20
# A tokenizer.model file: a few bytes a piece, for at most MAX_VOCAB pieces.
MAX_SENTENCEPIECE_BYTES = 32 << 20
# A tokenizer.json file: released ones are tens of megabytes at most.
MAX_TOKENIZER_JSON_BYTES = 256 << 20
# A JSON file beside the weights (config.json, tokenizer_config.json, an index).
MAX_SMALL_JSON_BYTES = 64 << 20
# A safetensors header (the safetensors library refuses more than 100 MB too).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, read only when there are at most ``max_bytes``;
    ValueError naming the file when there are more or it cannot be read."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ValueError(f"{path} is {size} bytes; a file of this kind is at most {max_bytes}")
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror}") from None


def read_json_file(path: Path, max_bytes: int = MAX_SMALL_JSON_BYTES) -> Any:
    """The JSON document in ``path`` (see ``read_bounded``, ``parse_json``)."""
    return parse_json(read_bounded(path, max_bytes), str(path))


def parse_json(data: bytes, where: str) -> Any:
    """``data`` as JSON; ValueError naming ``where`` for any way it is not."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{where} nests its JSON too deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None


def bounded_int(value: Any, where: str, low: int, high: int) -> int:
    """``value`` when it is an int (not a bool) within [low, high]; else a ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{where} must be an integer from {low} to {high}, got {short_repr(value)}")
    return value


def bounded_float(value: Any, where: str, high: float = math.inf, *, zero_ok: bool = False) -> float:
    """``value`` as a float when it is a finite number, positive (or zero when
    ``zero_ok``) and at most ``high``; else a ValueError naming ``where``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (0 <= value if zero_ok else 0 < value) or value > high:
        sign = "non-negative" if zero_ok else "positive"
        limit = "" if math.isinf(high) else f" at most {high:g}"
        raise ValueError(f"{where} must be a finite {sign} number{limit}, got {short_repr(value)}")
    return float(value)


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (a hostile value can be megabytes long)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
