"""A GGUF file opened once, its metadata as plain Python values.

GGUF (llama.cpp's format) keeps a model's config, tokenizer and chat
template as typed key/value metadata in front of its tensors. This wrapper
turns the ``gguf`` package's reader fields into ints, floats, strings and
lists, and every way a file can be unreadable into one ``ValueError``
naming the file, so callers (the model config, the tokenizer, the tensor
loader) do not each handle the reader's exceptions.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
_MISSING = object()


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC


def gguf_package() -> Any:
    """The ``gguf`` package, or a ValueError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise ValueError("GGUF files need the 'gguf' package: pip install 'octavo[gguf]'") from None
    return gguf


class GgufFile:
    """Metadata and tensor records of one GGUF file (memory-mapped, read lazily)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        gguf = gguf_package()
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # a truncated or corrupt file fails in numpy, struct or the reader itself
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from None
        self._fields = self.reader.fields
        self.architecture: str = self.require("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (arrays as lists), ``default`` when absent."""
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except Exception as exc:
            raise ValueError(f"{self.path}: metadata {key!r} cannot be read: {exc}") from None
        return value

    def require(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise ValueError(f"{self.path}: GGUF metadata has no {key!r}")
        return value

    def arch_key(self, suffix: str, default: Any = _MISSING) -> Any:
        """``<architecture>.<suffix>`` (llama.cpp prefixes model fields with the architecture)."""
        key = f"{self.architecture}.{suffix}"
        return self.require(key) if default is _MISSING else self.get(key, default)

    @property
    def tensors(self) -> list[Any]:
        """The reader's tensor records (name, tensor_type, shape, data)."""
        return self.reader.tensors


def open_gguf(path: str | Path) -> GgufFile:
    """``GgufFile(path)``, shared: the config, the tokenizer and the loader all
    read one file (a file rewritten in place is opened afresh)."""
    stat = Path(path).stat()
    return _open(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GgufFile:
    return GgufFile(path)
