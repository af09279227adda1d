"""What a GGUF file declares, read within bounds: integer and number metadata under ``<arch>.*``,
and tensors of the shape the metadata implies. A hostile file declares sizes far beyond what it
holds; every size the model is built from passes through here (and octavo/checkpoint/bounds.py),
so what is allocated is bounded by the file's own tensors."""
from __future__ import annotations

import math
from typing import Any

from octavo.checkpoint.bounds import bounded_float, bounded_int
from octavo.checkpoint.gguf_file import GgufFile, GgufTensor

REQUIRED = object()
# Widths and head counts: the widest released models are about 2^15 wide; a
# declared width the tensors do not have is refused by the loader's memory budget.
MAX_WIDTH = 1 << 20


def metadata_int(file: GgufFile, suffix: str, default: Any = REQUIRED, high: int = MAX_WIDTH, low: int = 1) -> int:
    """The integer metadata ``<arch>.<suffix>``, from ``low`` to ``high``; ValueError naming the key and its value."""
    value = file.arch_key(suffix) if default is REQUIRED else file.arch_key(suffix, default)
    return bounded_int(value, f"{file.path}: metadata '{file.architecture}.{suffix}'", low, high)


def metadata_float(file: GgufFile, suffix: str, default: Any = REQUIRED, high: float = math.inf) -> float:
    """The positive finite number metadata ``<arch>.<suffix>``; ValueError naming the key and its value."""
    value = file.arch_key(suffix) if default is REQUIRED else file.arch_key(suffix, default)
    return bounded_float(value, f"{file.path}: metadata '{file.architecture}.{suffix}'", high)


def check_tensor(file: GgufFile, tensors: dict[str, GgufTensor], name: str, shape: tuple[int, ...],
                 source: str) -> None:
    """ValueError naming tensor ``name`` where ``file`` lacks it or holds it in another shape than
    ``shape`` (GGUF order: innermost dim first), which follows from the metadata ``source`` names."""
    if name not in tensors:
        raise ValueError(f"{file.path} has no {name} tensor")
    if tuple(tensors[name].shape) != shape:
        raise ValueError(f"{file.path}: tensor {name} has shape {list(tensors[name].shape)}; expected "
                         f"{list(shape)} (GGUF order) from {source}")
