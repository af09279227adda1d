"""A safetensors file's header, checked against the file before the
safetensors library maps it.

The format is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{text: text}}``) and the tensors' bytes, offsets counted from the header's
end. Here the header length is held to the file's size and a cap, the JSON
to the structure above (which also bounds its nesting), every dtype to the
known ones, every tensor's bytes to its shape times its dtype's width, every
extent to the data region, and no two extents may overlap: whatever the
loader later allocates for a tensor is then at most what the file holds.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from octavo.checkpoint.bounds import MAX_SAFETENSORS_HEADER_BYTES, parse_json, short_repr

# Bits per element of each dtype the safetensors format names.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32, "U64": 64, "I64": 64,
    "F64": 64, "C64": 64,
}
_MAX_DIMS = 8


@dataclass(frozen=True)
class TensorExtent:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # from the start of the data region
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorExtent]
    data_bytes: int  # the data region's size

    def stored_bytes(self) -> int:
        return sum(t.end - t.begin for t in self.tensors.values())


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """The checked header of the safetensors file ``path``; ValueError naming the file and the field."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            # Read no further than the header's checked length (parse_safetensors_header says why not).
            body = f.read(length) if length <= min(MAX_SAFETENSORS_HEADER_BYTES, size - 8) else b""
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror}") from None
    return parse_safetensors_header(head + body, size, str(path))


def parse_safetensors_header(data: bytes, file_size: int, where: str) -> SafetensorsHeader:
    """The header at the start of ``data`` (at least the length and the JSON) of a
    ``file_size``-byte file; a ValueError "``where`` is not a readable safetensors
    file: ..." naming the field for any way it is not one."""
    try:
        return _parse(data, file_size)
    except ValueError as exc:
        raise ValueError(f"{where} is not a readable safetensors file: {exc}") from None


def _parse(data: bytes, file_size: int) -> SafetensorsHeader:
    if len(data) < 8:
        raise ValueError(f"it is {file_size} bytes, shorter than its header length")
    length = struct.unpack_from("<Q", data)[0]
    if length > min(MAX_SAFETENSORS_HEADER_BYTES, file_size - 8):
        raise ValueError(f"header length {length} exceeds the {file_size - 8} bytes after it or the limit of "
                         f"{MAX_SAFETENSORS_HEADER_BYTES}")
    if len(data) < 8 + length:
        raise ValueError("the header runs past the data given")
    header = parse_json(data[8:8 + length], "the header")
    if not isinstance(header, dict):
        raise ValueError(f"the header must be a JSON object, got {type(header).__name__}")
    data_bytes = file_size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ValueError(f"__metadata__ must map names to text, got {short_repr(entry)}")
        else:
            tensors[name] = _extent(name, entry, data_bytes)
    previous_end, previous = 0, None
    for name, extent in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if extent.begin < previous_end:
            raise ValueError(f"tensor {name!r:.80} (bytes {extent.begin} to {extent.end}) overlaps tensor "
                             f"{previous!r:.80}")
        previous_end, previous = max(previous_end, extent.end), name
    return SafetensorsHeader(tensors, data_bytes)


def _extent(name: str, entry: Any, data_bytes: int) -> TensorExtent:
    what = f"tensor {name!r:.80}"
    if not isinstance(entry, dict):
        raise ValueError(f"{what} must be an object with dtype, shape and data_offsets, got {short_repr(entry)}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ValueError(f"{what} has dtype {short_repr(dtype)}; known: {', '.join(DTYPE_BITS)}")
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ValueError(f"{what} has shape {short_repr(shape)}; a shape is a list of at most {_MAX_DIMS} "
                         "non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise ValueError(f"{what} has data_offsets {short_repr(offsets)}; they are two integers [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise ValueError(f"{what} has data_offsets [{begin}, {end}], outside the data region's {data_bytes} bytes")
    bits = prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * (end - begin):
        raise ValueError(f"{what}: shape {shape} of {dtype} is {bits / 8:g} bytes, its data_offsets span "
                         f"{end - begin}")
    return TensorExtent(dtype, tuple(shape), begin, end)
