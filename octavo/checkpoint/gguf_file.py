"""A GGUF file opened once: its metadata as plain Python values, its tensors
as records over one read-only memory map.

GGUF (llama.cpp's format) keeps a model's config, tokenizer and chat
template as typed key/value metadata in front of its tensors. The header is
parsed here rather than by the ``gguf`` package's reader for two reasons:
that reader builds a numpy view per array element (5 s for a 49k-token
vocabulary, on every start), and it trusts the counts a file declares. Here
every count and length is checked against the bytes left in the file and
the bounds of octavo/checkpoint/bounds.py before anything is read or
allocated, tensor extents against the file's size, and every way a file can
be unreadable is one ``ValueError`` naming the file and the field. The
``gguf`` package still supplies the format's constants (value and block
types, block sizes) and the dequantizers of block types.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from octavo.checkpoint.bounds import MAX_METADATA_ARRAY, MAX_METADATA_STRING, short_repr

_MAGIC = b"GGUF"
_MISSING = object()
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
# (struct format, numpy dtype) of each scalar value type, by GGUFValueType number.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file named *.gguf or starting with GGUF's magic bytes
    (a broken .gguf file is then reported as such, not as a folder without config.json)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC


def gguf_package() -> Any:
    """The ``gguf`` package (a main dependency: the default model is a GGUF file)."""
    import gguf

    return gguf


@dataclass(frozen=True)
class GgufTensor:
    """One tensor record: ``shape`` innermost dimension first (GGUF's order);
    ``data`` a read-only view of its bytes: float32/float16 values for F32/F16,
    else uint8 rows of ``shape[0]`` elements' blocks."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from ``buf``, never past its end."""

    def __init__(self, buf: mmap.mmap | bytes, where: Path) -> None:
        self.buf, self.pos, self.end, self.where = buf, 0, len(buf), where

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.where}: {what}")

    def take(self, size: int, what: str) -> int:
        start = self.pos
        if size < 0 or size > self.end - start:
            raise self.fail(f"{what} needs {size} bytes at offset {start}; the file has {self.end - start} left")
        self.pos += size
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        if length > MAX_METADATA_STRING:
            raise self.fail(f"{what} declares a string of {length} bytes; at most {MAX_METADATA_STRING} are read")
        start = self.take(length, what)
        try:
            return bytes(self.buf[start:start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            value = self.scalar(_SCALARS[kind][0], what)
            return bool(value) if kind == _BOOL else value
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            return self.array(what)
        raise self.fail(f"{what} has unknown value type {kind}")

    def array(self, what: str) -> list[Any]:
        kind = self.scalar("<I", what)
        count = self.scalar("<Q", what)
        if count > MAX_METADATA_ARRAY:
            raise self.fail(f"{what} declares {count} elements; at most {MAX_METADATA_ARRAY} are read")
        if kind in _SCALARS:  # read in one go, after checking the bytes are there
            dtype = np.dtype(_SCALARS[kind][1])
            start = self.take(count * dtype.itemsize, what)
            values = np.frombuffer(self.buf, dtype, count, start).tolist()
            return [bool(v) for v in values] if kind == _BOOL else values
        if kind == _STRING:
            if count > (self.end - self.pos) // 8:  # each string takes at least its 8-byte length
                raise self.fail(f"{what} declares {count} strings; the file has room for fewer")
            return [self.string(what) for _ in range(count)]
        if kind == _ARRAY:
            raise self.fail(f"{what} is an array of arrays, which no model field is")
        raise self.fail(f"{what} has unknown element type {kind}")


class GgufFile:
    """Metadata and tensor records of one GGUF file (memory-mapped, read lazily)."""

    def __init__(self, path: str | Path, contents: Optional[bytes] = None) -> None:
        """The file at ``path``, memory-mapped; or ``contents`` given as bytes
        (``path`` then only names it in errors: the parsers' fuzzer uses this)."""
        self.path = Path(path)
        if contents is not None:
            self._map: mmap.mmap | bytes = contents
        else:
            try:
                with open(self.path, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
                raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from None
        cursor = _Cursor(self._map, self.path)
        if cursor.end < 24 or bytes(self._map[:4]) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic and header)")
        cursor.pos = 4
        version = cursor.scalar("<I", "version")
        if version not in _VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (supported: 2, 3; "
                             "a big-endian file also shows here)")
        tensor_count = cursor.scalar("<Q", "tensor_count")
        kv_count = cursor.scalar("<Q", "metadata_kv_count")
        # Smallest possible entries: a key/value is 8 + 4 + 1 bytes, a tensor record 8 + 4 + 8 + 4 + 8.
        if kv_count > cursor.end // 13 or tensor_count > cursor.end // 32:
            raise ValueError(f"{self.path}: declares {kv_count} metadata entries and {tensor_count} tensors, "
                             f"more than its {cursor.end} bytes can hold")
        self._fields: dict[str, Any] = {}
        for i in range(kv_count):
            key = cursor.string(f"metadata key {i}")
            if key in self._fields:
                raise ValueError(f"{self.path}: metadata key {key!r} appears twice")
            self._fields[key] = cursor.value(cursor.scalar("<I", key), f"metadata {key!r}")
        self.tensors: list[GgufTensor] = self._read_tensors(cursor, tensor_count)
        self.architecture: str = self.require("general.architecture", str)

    def _read_tensors(self, cursor: _Cursor, count: int) -> list[GgufTensor]:
        gguf = gguf_package()
        infos = []
        for i in range(count):
            name = cursor.string(f"tensor {i}'s name")
            dims = cursor.scalar("<I", f"tensor {name!r}'s dimension count")
            if not 1 <= dims <= _MAX_DIMS:
                raise cursor.fail(f"tensor {name!r} has {dims} dimensions (1 to {_MAX_DIMS})")
            shape = tuple(cursor.scalar("<Q", f"tensor {name!r}'s shape") for _ in range(dims))
            type_id = cursor.scalar("<I", f"tensor {name!r}'s type")
            offset = cursor.scalar("<Q", f"tensor {name!r}'s offset")
            infos.append((name, shape, type_id, offset))
        alignment = self.get("general.alignment", _DEFAULT_ALIGNMENT, int)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        data_start = -(-cursor.pos // alignment) * alignment
        tensors, seen = [], set()
        for name, shape, type_id, offset in infos:
            if name in seen:
                raise ValueError(f"{self.path}: tensor {name!r} appears twice")
            seen.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
                block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ValueError(f"{self.path}: tensor {name!r} has unknown type {type_id}") from None
            if any(d == 0 for d in shape) or shape[0] % block:
                raise ValueError(f"{self.path}: tensor {name!r} has shape {list(shape)}, not whole "
                                 f"{qtype.name} blocks of {block}")
            rows, row_bytes = prod(shape[1:]), shape[0] // block * block_bytes
            start, size = data_start + offset, rows * row_bytes
            if offset % alignment or start + size > cursor.end:
                raise ValueError(f"{self.path}: tensor {name!r} ({size} bytes at offset {offset}) lies outside "
                                 f"the file's {cursor.end} bytes or off its {alignment}-byte alignment")
            tensors.append(GgufTensor(name, qtype, shape, self._view(qtype.name, start, size, rows, row_bytes)))
        return tensors

    def _view(self, type_name: str, start: int, size: int, rows: int, row_bytes: int) -> np.ndarray:
        if type_name in ("F32", "F16"):
            dtype = np.dtype("<f4" if type_name == "F32" else "<f2")
            return np.frombuffer(self._map, dtype, size // dtype.itemsize, start)
        return np.frombuffer(self._map, np.uint8, size, start).reshape(rows, row_bytes)

    def get(self, key: str, default: Any = None, kind: type | Callable[[Any], bool] | None = None) -> Any:
        """The value of metadata ``key`` (arrays as lists), ``default`` when absent.
        ``kind``: the type the value must have (int accepts no bool; float accepts
        int; list), else a ValueError naming the key and what it holds."""
        value = self._fields.get(key, _MISSING)
        if value is _MISSING:
            return default
        if kind is not None and not _is(value, kind):
            raise ValueError(f"{self.path}: metadata {key!r} must be {getattr(kind, '__name__', kind)}; "
                             f"it holds {type(value).__name__} {short_repr(value)}")
        return value

    def require(self, key: str, kind: type | Callable[[Any], bool] | None = None) -> Any:
        value = self.get(key, _MISSING, kind)
        if value is _MISSING:
            raise ValueError(f"{self.path}: GGUF metadata has no {key!r}")
        return value

    def arch_key(self, suffix: str, default: Any = _MISSING, kind: type | Callable[[Any], bool] | None = None) -> Any:
        """``<architecture>.<suffix>`` (llama.cpp prefixes model fields with the architecture)."""
        key = f"{self.architecture}.{suffix}"
        return self.require(key, kind) if default is _MISSING else self.get(key, default, kind)


def list_of(kind: type) -> Callable[[Any], bool]:
    """A ``kind`` for ``GgufFile.get``: a list whose every element is ``kind``."""
    def check(value: Any) -> bool:
        return isinstance(value, list) and all(_is(v, kind) for v in value)

    check.__name__ = f"a list of {kind.__name__}"
    return check


def _is(value: Any, kind: type | Callable[[Any], bool]) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(kind, type):
        return isinstance(value, kind)
    return kind(value)


def open_gguf(path: str | Path) -> GgufFile:
    """``GgufFile(path)``, shared: the config, the tokenizer and the loader all
    read one file (a file rewritten in place is opened afresh)."""
    stat = Path(path).stat()
    return _open(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GgufFile:
    return GgufFile(path)
