"""The paged KV cache tensors: sizing from the memory budget, allocation, block copies."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

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
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


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


def allocate_kv_caches(shape: CacheShape, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.

    Zero-filled: padded slots of a gathered block are masked out of attention,
    but a NaN bit pattern left in fresh memory would still poison the weighted
    sum (0 * NaN)."""
    caches = [
        torch.zeros(2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
        for _ in range(shape.num_layers)
    ]
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)",
        num_blocks, shape.block_size, num_blocks * shape.block_size,
        num_blocks * shape.bytes_per_block / 2**20, shape.dtype,
    )
    return caches


def copy_blocks(kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: block dst gets block src's K/V in every layer."""
    if not copies:
        return
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    for cache in kv_caches:
        cache.index_copy_(1, dst, cache.index_select(1, src))
