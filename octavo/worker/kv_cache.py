"""The paged KV cache tensors: sizing from the memory budget, allocation, block copies.

A quantized cache (int8 / fp8) costs head_dim + 4 bytes per token, KV head
and K or V (one byte per element, a float32 scale) against 2 * head_dim for
bf16: 1.88x the tokens in the same memory at head_dim 64, 1.94x at 128."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from octavo.attention.kv_quant import SCALE_BYTES, LayerKVCache, allocate_layer_cache, is_quantized
from octavo.attention.kv_quant import copy_blocks as copy_layer_blocks
from octavo.config import CacheConfig
from octavo.worker.memory import available_memory_bytes, check_pool_fits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheShape:
    """One rank's shard: its pipeline stage's layers, its tensor-parallel
    share of the KV heads."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # stored elements: a float dtype, or int8 / float8_e4m3fn with scales

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block, their scales included."""
        element = torch.empty((), dtype=self.dtype).element_size()
        row = self.head_dim * element + (SCALE_BYTES if is_quantized(self.dtype) else 0)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row


def num_cache_blocks(
    config: CacheConfig,
    shape: CacheShape,
    device: torch.device,
    max_useful_tokens: Optional[int] = None,
    memory_share: float = 1.0,
    extra_shapes: Sequence[CacheShape] = (),
) -> int:
    """Forced ``num_blocks`` first, else ``kv_cache_memory_bytes``, else
    ``memory_fraction`` of the memory available now (after the weights).

    The fraction-of-memory default is capped at ``max_useful_tokens``
    (max_num_seqs * max_model_len, twice over for the prefix cache): more
    blocks could never hold live tokens, and allocating them costs seconds
    of zero-filling and gigabytes of resident memory on CPU.

    An explicit size must fit the memory available (``check_pool_fits``).
    ``memory_share``: this rank's part of the memory budgets, when several
    ranks draw on one memory (CPU ranks of one machine: 1 / their number).
    ``extra_shapes``: caches indexed by the same block ids (a draft model's),
    whose bytes each block costs too."""
    bytes_per_block = shape.bytes_per_block + sum(s.bytes_per_block for s in extra_shapes)
    if config.num_blocks is not None:
        check_pool_fits(config.num_blocks * bytes_per_block, device, "num_blocks (--num-blocks)")
        return config.num_blocks
    budget = config.kv_cache_memory_bytes
    if budget is not None:
        budget = int(budget * memory_share)
        check_pool_fits(budget, device, "kv_cache_memory_bytes (--kv-cache-memory)")
    else:
        budget = int(available_memory_bytes(device) * config.memory_fraction * memory_share)
        if max_useful_tokens is not None:
            cap_blocks = 2 * -(-max_useful_tokens // shape.block_size)
            budget = min(budget, cap_blocks * bytes_per_block)
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is below one block ({bytes_per_block} bytes); "
            "raise kv_cache_memory_bytes or memory_fraction"
        )
    return blocks


def allocate_kv_caches(
    shape: CacheShape, num_blocks: int, device: torch.device,
    static_scales: Optional[list[Optional[torch.Tensor]]] = None, padding_blocks: int = 0,
) -> list[LayerKVCache]:
    """One zero-filled cache per layer (``LayerKVCache``) of ``num_blocks``
    for the scheduler's pool plus ``padding_blocks`` after them that no
    request owns (recorded decode steps pad into one); ``static_scales``:
    per layer, the checkpoint's [2, kv_heads] K/V scales or None (quantized
    caches only)."""
    caches = [
        allocate_layer_cache(num_blocks + padding_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, shape.dtype, device,
                             static_scales[i] if static_scales else None)
        for i in range(shape.num_layers)
    ]
    scales = ""
    if is_quantized(shape.dtype):
        fixed = sum(c.static_scales is not None for c in caches)
        scales = (f" + float32 scales per token and KV head"
                  f"{f' (static from the checkpoint in {fixed} layers)' if fixed else ''}")
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s%s)%s",
        num_blocks, shape.block_size, num_blocks * shape.block_size,
        num_blocks * shape.bytes_per_block / 2**20, shape.dtype, scales,
        f", and {padding_blocks} padding block{'s' * (padding_blocks > 1)}" if padding_blocks else "",
    )
    return caches


def copy_blocks(kv_caches: list[LayerKVCache], copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: block dst gets block src's K/V (and scales) in every layer."""
    if not copies:
        return
    device = kv_caches[0].data.device
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    for cache in kv_caches:
        copy_layer_blocks(cache, src, dst)
