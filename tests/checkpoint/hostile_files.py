"""Model files written to hurt a loader: counts and lengths that declare far
more than the file holds, metadata of the wrong type, config values no
architecture can run. Each is made from a valid tiny model (a Hugging Face
folder and its GGUF file) with one thing changed, and comes with what its
error must name: the file, the field and the value.

Used by tests/checkpoint/test_hostile_files.py (each file, one error) and
benchmarks/hostile_files.py (the memory each takes to refuse)."""
from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tests.checkpoint.gguf_writer import rewrite_gguf, write_gguf
from tests.model_factory import make_tiny_model


@dataclass(frozen=True)
class HostileCase:
    name: str
    # What reads it: "config" (the model's config), "tokenizer" or "model" (the whole load).
    reader: str
    build: Callable[[Path, "ValidModel"], Path]
    words: tuple[str, ...]  # what the error line must name, besides the file


@dataclass(frozen=True)
class ValidModel:
    folder: Path  # a tiny Llama checkpoint folder (config.json, model.safetensors, tokenizer.json)
    gguf: Path  # the same model as a GGUF file


def valid_model(root: Path) -> ValidModel:
    folder = make_tiny_model(root / "hf", "llama")
    return ValidModel(folder, write_gguf(folder, root / "valid.gguf"))


# ---- GGUF ---------------------------------------------------------------------------


def _gguf_with(**fields: Any) -> Callable[[Path, ValidModel], Path]:
    def build(root: Path, valid: ValidModel) -> Path:
        return rewrite_gguf(valid.gguf, root / "model.gguf", **fields)

    return build


def _gguf_bytes(entries: list[bytes]) -> bytes:
    """A GGUF v3 file of no tensors and the metadata ``entries`` (from ``_kv``)."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries)


def _text(value: str) -> bytes:
    data = value.encode()
    return struct.pack("<Q", len(data)) + data


def _kv(key: str, value_type: int, payload: bytes) -> bytes:
    return _text(key) + struct.pack("<I", value_type) + payload


_STRING, _ARRAY, _UINT8 = 8, 9, 0


def _huge_u8_array(root: Path, valid: ValidModel) -> Path:
    """An array declaring 2^50 one-byte elements, followed by a few."""
    entries = [_kv("general.architecture", _STRING, _text("llama")),
               _kv("tokenizer.ggml.token_type", _ARRAY, struct.pack("<IQ", _UINT8, 1 << 50) + bytes(64))]
    path = root / "model.gguf"
    path.write_bytes(_gguf_bytes(entries))
    return path


def _empty_tokens(root: Path, valid: ValidModel) -> Path:
    """Two million empty token strings: each takes 8 bytes in the file and an object in memory."""
    count = 2_000_000
    entries = [_kv("general.architecture", _STRING, _text("llama")),
               _kv("tokenizer.ggml.model", _STRING, _text("gpt2")),
               _kv("tokenizer.ggml.tokens", _ARRAY, struct.pack("<IQ", _STRING, count) + bytes(8 * count))]
    path = root / "model.gguf"
    path.write_bytes(_gguf_bytes(entries))
    return path


# ---- tokenizer.model ----------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    if wire == 2:
        payload = _varint(len(payload)) + payload
    return _varint(number << 3 | wire) + payload


def _piece(text: bytes, score: float = 0.0, kind: int = 1) -> bytes:
    return _field(1, 2, _field(1, 2, text) + _field(2, 5, struct.pack("<f", score)) + _field(3, 0, _varint(kind)))


def _spm_folder(root: Path, valid: ValidModel, model: bytes) -> Path:
    """The valid folder with tokenizer.model ``model`` in place of tokenizer.json."""
    folder = root / "model"
    shutil.copytree(valid.folder, folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(model)
    return folder


_SPM_PIECES = b"".join(_piece(p) for p in (b"<unk>", b"<s>", b"</s>"))


def _spm_case(model: bytes) -> Callable[[Path, ValidModel], Path]:
    return lambda root, valid: _spm_folder(root, valid, model)


# A piece whose text is stored as a 10-byte varint of 2^31, not as bytes: read as
# a length, it was a 2 GiB allocation.
_SPM_VARINT_TEXT = _SPM_PIECES + _field(1, 2, _field(1, 0, _varint(1 << 31)))
# A piece declaring 2^31 bytes of text in a 10-byte length field, with a few behind it.
_SPM_LONG_LENGTH = _SPM_PIECES + _field(1, 2, _varint(1 << 3 | 2) + _varint(1 << 31) + b"abc")
# One piece of 1.5M characters: deriving merges tried each of its 1.5M splits.
_SPM_LONG_PIECE = _SPM_PIECES + _piece(b"a" * 1_500_000)
# A piece's score stored as a varint, its type as bytes.
_SPM_SCORE_VARINT = _SPM_PIECES + _field(1, 2, _field(1, 2, b"x") + _field(2, 0, _varint(5)))
_SPM_TYPE_BYTES = _SPM_PIECES + _field(1, 2, _field(1, 2, b"x") + _field(3, 2, b"\x01"))


# ---- config.json, safetensors, tokenizer files -------------------------------------


def _folder_with(edit: Callable[[Path], None]) -> Callable[[Path, ValidModel], Path]:
    def build(root: Path, valid: ValidModel) -> Path:
        folder = root / "model"
        shutil.copytree(valid.folder, folder)
        edit(folder)
        return folder

    return build


def _config(**fields: Any) -> Callable[[Path, ValidModel], Path]:
    def edit(folder: Path) -> None:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))

    return _folder_with(edit)


def _header(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path, ValidModel], Path]:
    """The folder with model.safetensors' header JSON edited (the data region kept)."""
    def rewrite(folder: Path) -> None:
        path = folder / "model.safetensors"
        data = path.read_bytes()
        length = struct.unpack_from("<Q", data)[0]
        header = json.loads(data[8:8 + length])
        edit(header)
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])

    return _folder_with(rewrite)


def _first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return header[sorted(k for k in header if k != "__metadata__")[0]]


def _set_first(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: _first_tensor(header).update(fields)


def _overlap(header: dict[str, Any]) -> None:
    """The last tensor's extent moved onto the first's bytes (the same size, inside the region)."""
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    first, last = header[names[0]]["data_offsets"], header[names[-1]]["data_offsets"]
    size = last[1] - last[0]
    header[names[-1]]["data_offsets"] = [first[0], first[0] + size]


def _write(name: str, content: bytes | str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / name).write_bytes(content.encode() if isinstance(content, str) else content)

    return edit


def _huge_header_length(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 62) + data[8:])


def _deep_header(folder: Path) -> None:
    """A header nesting 100k arrays: past any JSON parser's recursion."""
    path = folder / "model.safetensors"
    text = b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path.write_bytes(struct.pack("<Q", len(text)) + text)


CASES: tuple[HostileCase, ...] = (
    # GGUF metadata of the wrong type, and counts past any model.
    HostileCase("gguf-merges-as-integers", "tokenizer", _gguf_with(**{"tokenizer.ggml.merges": [1, 2, 3]}),
                ("tokenizer.ggml.merges", "a list of str")),
    HostileCase("gguf-tokens-as-integers", "tokenizer", _gguf_with(**{"tokenizer.ggml.tokens": [1, 2, 3]}),
                ("tokenizer.ggml.tokens", "a list of str")),
    HostileCase("gguf-merge-of-unknown-tokens", "tokenizer", _gguf_with(**{"tokenizer.ggml.merges": ["zzz yyy"]}),
                ("tokenizer.ggml.merges", "zzz")),
    HostileCase("gguf-chat-template-as-integer", "tokenizer", _gguf_with(**{"tokenizer.chat_template": 7}),
                ("tokenizer.chat_template", "must be str", "7")),
    HostileCase("gguf-context-length-2^62", "config", _gguf_with(**{"llama.context_length": 1 << 62}),
                ("llama.context_length", str(1 << 62))),
    HostileCase("gguf-block-count-10^9", "config", _gguf_with(**{"llama.block_count": 10**9}),
                ("llama.block_count", str(10**9))),
    HostileCase("gguf-block-count-above-the-tensors", "config", _gguf_with(**{"llama.block_count": 5}),
                ("llama.block_count", "5", "2 blocks")),
    HostileCase("gguf-rope-factor-nan", "config",
                _gguf_with(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": float("nan")}),
                ("llama.rope.scaling.factor", "nan")),
    HostileCase("gguf-u8-array-2^50", "config", _huge_u8_array, ("tokenizer.ggml.token_type", str(1 << 50))),
    HostileCase("gguf-2M-empty-tokens", "tokenizer", _empty_tokens, ("tokenizer.ggml.tokens", "2000000 elements")),
    # tokenizer.model.
    HostileCase("spm-text-as-varint-2^31", "tokenizer", _spm_case(_SPM_VARINT_TEXT), ("piece 3", "wire type 0")),
    HostileCase("spm-length-2^31", "tokenizer", _spm_case(_SPM_LONG_LENGTH), ("piece 3", "2147483648 bytes")),
    HostileCase("spm-piece-of-1.5M-characters", "tokenizer", _spm_case(_SPM_LONG_PIECE),
                ("piece 3", "1500000 bytes")),
    HostileCase("spm-score-as-varint", "tokenizer", _spm_case(_SPM_SCORE_VARINT),
                ("piece 3", "field 2", "wire type 0")),
    HostileCase("spm-type-as-bytes", "tokenizer", _spm_case(_SPM_TYPE_BYTES), ("piece 3", "field 3", "wire type 2")),
    # config.json values no architecture can run.
    HostileCase("config-layers-10^9", "config", _config(num_hidden_layers=10**9),
                ("config.json", "num_hidden_layers", str(10**9))),
    HostileCase("config-layers-above-the-tensors", "model", _config(num_hidden_layers=6),
                ("num_hidden_layers is 6", "2 layers")),
    HostileCase("config-hidden-size-above-the-tensors", "model", _config(hidden_size=1 << 20, head_dim=16),
                ("hidden_size 1048576", "bytes")),
    *(HostileCase(f"config-rope-factor-{factor}", "config",
                  _config(rope_parameters={"rope_type": "linear", "factor": factor, "rope_theta": 1e4}),
                  ("config.json", "rope factor", repr(factor)))
      for factor in (0, -1, 1e308, float("nan"))),
    HostileCase("config-yarn-original-length-0", "config",
                _config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                         "original_max_position_embeddings": 0}),
                ("config.json", "original_max_position_embeddings", "0")),
    HostileCase("config-negative-rope-theta", "config", _config(rope_theta=-10000.0, rope_parameters=None),
                ("config.json", "rope_theta", "-10000.0")),
    HostileCase("config-negative-sliding-window", "config",
                _config(architectures=["MistralForCausalLM"], sliding_window=-4),
                ("config.json", "sliding_window", "-4")),
    HostileCase("config-context-2^62", "config", _config(max_position_embeddings=1 << 62),
                ("config.json", "max_position_embeddings", str(1 << 62))),
    # safetensors headers.
    HostileCase("safetensors-header-length-2^62", "model", _folder_with(_huge_header_length),
                ("model.safetensors", "header length", str(1 << 62))),
    HostileCase("safetensors-deep-json", "model", _folder_with(_deep_header), ("model.safetensors", "too deep")),
    HostileCase("safetensors-unknown-dtype", "model", _header(_set_first(dtype="F128")),
                ("model.safetensors", "dtype", "F128")),
    HostileCase("safetensors-shape-past-its-bytes", "model", _header(_set_first(shape=[1 << 40, 1 << 40])),
                ("model.safetensors", "shape", str(1 << 40))),
    HostileCase("safetensors-offsets-past-the-file", "model", _header(_set_first(data_offsets=[0, 1 << 40])),
                ("model.safetensors", "data_offsets", str(1 << 40))),
    HostileCase("safetensors-overlapping-tensors", "model", _header(_overlap), ("model.safetensors", "overlaps")),
    # tokenizer.json and tokenizer_config.json.
    HostileCase("tokenizer-json-of-the-wrong-type", "tokenizer", _folder_with(_write("tokenizer.json", '{"model": 5}')),
                ("tokenizer.json", "not a tokenizer")),
    HostileCase("tokenizer-config-template-as-integer", "tokenizer",
                _folder_with(_write("tokenizer_config.json", '{"chat_template": 7}')),
                ("tokenizer_config.json", "chat_template", "7")),
)
