"""Attention backends by name (``ModelConfig.attention_backend``), and the
choice behind "auto": the first registered backend that fits the device and
dtypes and builds here (the native kernel on CPU, Triton on CUDA, else torch)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from octavo.attention.base import AttentionBackend
from octavo.attention.native_cpu import NativeCpuBackend
from octavo.attention.torch_sdpa import TorchSdpaBackend
from octavo.attention.triton_cuda import TritonBackend

# In "auto"'s order of preference.
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (NativeCpuBackend, TritonBackend, TorchSdpaBackend)
}


def register_attention_backend(cls: type[AttentionBackend]) -> None:
    """Make ``cls`` selectable as ``attention_backend=cls.name``; "auto" prefers the built-in ones,
    which come first (torch's runs everywhere)."""
    ATTENTION_BACKENDS[cls.name] = cls


def select_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, windows: Iterable[Optional[int]]
) -> AttentionBackend:
    """The backend ``name`` ("auto" or a registered name) for a model of
    ``dtype`` on ``device`` with a cache of ``cache_dtype``; ``windows``: the
    model's sliding windows. ValueError when a named backend cannot run there."""
    if name == "auto":
        for cls in ATTENTION_BACKENDS.values():
            backend = cls.create(windows, required=False) if cls.supports(device, dtype, cache_dtype) else None
            if backend is not None:
                return backend
        raise ValueError(f"no attention backend runs {dtype} with a {cache_dtype} cache on {device.type}")
    cls = ATTENTION_BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"attention_backend must be one of auto, {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    if not cls.supports(device, dtype, cache_dtype):
        raise ValueError(f"attention_backend {name!r} {cls.requirement}; got device {device.type}, "
                         f"dtype {dtype}, cache dtype {cache_dtype}")
    backend = cls.create(windows, required=True)
    if backend is None:  # create(required=True) raises instead; a backend that does not is a bug
        raise RuntimeError(f"attention backend {name!r} could not be created")
    return backend
