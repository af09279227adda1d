"""What each attention layer keeps per token in the paged cache.

A layer declares its ``KVCacheSpec``; the worker sizes the pool from the specs of every cache
tensor (bytes per block, summed; layers of different KV cache groups share tensors, kv_groups.py)
and asks the attention backend to allocate each one from its spec, in the backend's own layout. A new kind of cache (DeepSeek's latent vector, a layer that
keeps only its window) is a new spec; a new layout is a new backend."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from octavo.attention.kv_quant import SCALE_BYTES, bounds_dtype, is_quantized


@dataclass(frozen=True)
class KVCacheSpec:
    """K and V for every position: ``num_kv_heads`` x ``head_dim`` each, of ``dtype`` (a float
    dtype, or int8 / float8_e4m3fn with a float32 scale per token and head); with ``key_bounds``
    also each block's elementwise key minimum and maximum per head (sparse attention)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    key_bounds: bool = field(default=False, kw_only=True)  # keyword-only: subclasses' fields stay positional
    # Vectors kept per token and head: K and V (a latent cache keeps one).
    parts: ClassVar[int] = 2

    @property
    def kind(self) -> str:
        return "full"

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        scale = SCALE_BYTES if is_quantized(self.dtype) else 0
        return self.parts * self.num_kv_heads * (self.head_dim * element + scale)

    @property
    def bound_bytes_per_block(self) -> int:
        """The key bounds of one block: a minimum and a maximum per head and channel."""
        if not self.key_bounds:
            return 0
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=bounds_dtype(self.dtype)).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token + self.bound_bytes_per_block

    def describe(self) -> str:
        scales = " + float32 scales per token and KV head" if is_quantized(self.dtype) else ""
        bounds = f" + key min/max per block ({bounds_dtype(self.dtype)})" if self.key_bounds else ""
        return f"{self.kind}: {self.num_kv_heads} KV heads x {self.head_dim}, {self.dtype}{scales}{bounds}"


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A layer that attends to its last ``window`` positions only (its queries read no further)."""

    window: Optional[int] = None

    @property
    def kind(self) -> str:
        return f"sliding window {self.window}"


@dataclass(frozen=True)
class LatentKVCacheSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one vector per token instead of K and V per
    head, the compressed latent (kv_lora_rank) followed by the rotary key every head shares
    (``rope_dim``); heads decompress their keys and values from it, or absorb their projections
    into the query and output. Kept as a single "head" of ``head_dim`` = kv_lora_rank + rope_dim;
    quantized (int8 / fp8), with one scale per token over the whole vector, as a K/V cache keeps
    one per token and head (kv_quant.py), so the backends' quantized decode reads it unchanged."""

    rope_dim: int = 0
    parts: ClassVar[int] = 1

    @property
    def kind(self) -> str:
        return f"latent {self.head_dim - self.rope_dim} + rope {self.rope_dim}"

    def describe(self) -> str:
        scales = " + a float32 scale per token" if is_quantized(self.dtype) else ""
        return f"{self.kind}, {self.dtype}{scales}"
