"""What a KV block file must match to be loaded: the model and the layout of
the rank's cache (torch-free)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_SAMPLES = 16
_SAMPLE_BYTES = 4096


def model_identity(path: str | Path) -> bytes:
    """A digest of a model folder (or GGUF file): config.json and, for every
    weight file, its name, size and 16 samples of 4 KiB spread over it.
    Hashing every weight byte would add seconds per GB to each start; two
    checkpoints of one architecture (a fine-tune and its base) have equal
    configs and sizes but differ throughout their weights, so the samples
    tell them apart."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    h = hashlib.sha256()
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        h.update(config.read_bytes())
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


def cache_fingerprint(models: Sequence[bytes], tensors: Sequence[str], block_size: int, rank: int,
                      world_size: int) -> bytes:
    """The fingerprint of one rank's blocks: ``models`` (``model_identity`` of
    the model and any draft model sharing the pool), ``tensors`` (each cache
    tensor's shape per block and dtype, in order: the KV layout, heads per
    shard and element types), the block size and the rank's place."""
    text = repr((tuple(m.hex() for m in models), tuple(tensors), block_size, rank, world_size))
    return hashlib.sha256(text.encode()).digest()


def group_fingerprint(fingerprint: bytes, group: int) -> bytes:
    """The fingerprint of one KV cache group's blocks on a rank: the groups of a model with
    sliding-window layers cache the same prefix in blocks of different layers, so a block file is
    keyed by its group too. Group 0 (a one-group model's only one) keeps the rank's fingerprint."""
    return fingerprint if group == 0 else hashlib.sha256(fingerprint + group.to_bytes(4, "little")).digest()
