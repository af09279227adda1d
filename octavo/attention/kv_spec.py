"""What each attention layer keeps per token in the paged cache.

A layer declares its ``KVCacheSpec``; the worker sizes the pool from the specs of every layer
(bytes per block, summed) and asks the attention backend to allocate each layer's cache from its
spec, in the backend's own layout. A new kind of cache (DeepSeek's latent vector, a layer that
keeps only its window) is a new spec; a new layout is a new backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from octavo.attention.kv_quant import SCALE_BYTES, is_quantized


@dataclass(frozen=True)
class KVCacheSpec:
    """K and V for every position: ``num_kv_heads`` x ``head_dim`` each, of ``dtype`` (a float
    dtype, or int8 / float8_e4m3fn with a float32 scale per token and head)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def kind(self) -> str:
        return "full"

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_kv_heads * (self.head_dim * element + (SCALE_BYTES if is_quantized(self.dtype) else 0))

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def describe(self) -> str:
        scales = " + float32 scales per token and KV head" if is_quantized(self.dtype) else ""
        return f"{self.kind}: {self.num_kv_heads} KV heads x {self.head_dim}, {self.dtype}{scales}"


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A layer that attends to its last ``window`` positions only (its queries read no further)."""

    window: Optional[int] = None

    @property
    def kind(self) -> str:
        return f"sliding window {self.window}"
