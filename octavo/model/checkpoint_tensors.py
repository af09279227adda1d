"""Where a checkpoint's tensors come from: one small interface over the file
formats, so the loader matches names and fills parameters the same way for
all of them.

A folder holds safetensors (``model.safetensors`` or shards named by
``model.safetensors.index.json``) or PyTorch pickles (``pytorch_model.bin``
or shards named by ``pytorch_model.bin.index.json``); when both are present
the safetensors are read: they need no unpickling and map without copying.
GGUF files have their own source (octavo/model/gguf/).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from octavo.checkpoint.bounds import read_json_file
from octavo.checkpoint.safetensors_header import read_safetensors_header

_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
_TORCH_BIN = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class TensorSource(ABC):
    """A checkpoint's tensors under their Hugging Face names."""

    #: what to name in errors: the folder or file the tensors are in
    where: Path

    @abstractmethod
    def names(self) -> set[str]:
        """Every tensor name the checkpoint holds (read without reading the tensors where the format allows)."""

    @abstractmethod
    def tensors(self, wanted: set[str], device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for each name of ``wanted`` the checkpoint holds, each read once."""

    @abstractmethod
    def stored_bytes(self) -> int:
        """The bytes the checkpoint's tensors take as stored (what bounds the model built for it)."""


class SafetensorsSource(TensorSource):
    """Safetensors files, each header checked against its file (octavo/checkpoint/safetensors_header.py)
    before the safetensors library maps it."""

    def __init__(self, files: list[Path]) -> None:
        self.files, self.where = files, files[0].parent
        self._headers = [read_safetensors_header(file) for file in files]

    def names(self) -> set[str]:
        return {name for header in self._headers for name in header.tensors}

    def stored_bytes(self) -> int:
        return sum(header.stored_bytes() for header in self._headers)

    def tensors(self, wanted: set[str], device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with _open_safetensors(file, device) as f:
                for name in f.keys():
                    if name in wanted:
                        yield name, f.get_tensor(name)


def _open_safetensors(file: Path, device: str | torch.device) -> Any:
    """``safe_open``, its failures (a corrupt header, a truncated file) a ValueError naming the file."""
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except Exception as exc:  # SafetensorError, OSError: all mean "not readable"
        raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None


class TorchBinSource(TensorSource):
    """``pytorch_model.bin`` files, loaded with ``weights_only=True``: only
    tensors and plain containers unpickle, so a checkpoint cannot run code."""

    def __init__(self, files: list[Path], index_names: set[str] | None) -> None:
        self.files, self.where, self._index_names = files, files[0].parent, index_names

    def names(self) -> set[str]:
        if self._index_names is not None:
            return set(self._index_names)
        return {name for file in self.files for name in _load_bin(file)}

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for file in self.files for t in _load_bin(file).values())

    def tensors(self, wanted: set[str], device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            state = _load_bin(file)
            for name, tensor in state.items():
                if name in wanted:
                    yield name, tensor.to(device)
            del state  # one shard's mapping open at a time


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A state dict from ``file``, memory-mapped (tensors are paged in as they
    are copied into parameters, not all read first). Files in torch's legacy
    (pre-1.6, not zip) format cannot be mapped and are read whole."""
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors, truncated zips, forbidden globals: all mean "not loadable"
        raise ValueError(f"cannot read {file} as a PyTorch checkpoint (weights only): {exc}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file} does not hold a state dict of tensors")
    return state


def folder_source(folder: Path) -> TensorSource:
    """The tensors of a Hugging Face checkpoint folder (safetensors preferred)."""
    files = _indexed_files(folder, *_SAFETENSORS)
    if files is not None:
        return SafetensorsSource(files[0])
    files = _indexed_files(folder, *_TORCH_BIN)
    if files is not None:
        return TorchBinSource(*files)
    raise ValueError(
        f"no weights in {folder}: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json"
    )


def _indexed_files(folder: Path, single: str, index_name: str) -> tuple[list[Path], set[str] | None] | None:
    """([files], names from the index or None) for one format, None when the folder has neither file."""
    index = folder / index_name
    if index.is_file():
        document = read_json_file(index)
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} is not a weight index (a JSON object with a 'weight_map' of file names)")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
        if outside:
            raise ValueError(f"{index} names shards outside its folder: {outside[:3]}")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are missing: {missing}")
        return [folder / n for n in names], set(weight_map)
    if (folder / single).is_file():
        return [folder / single], None
    return None
