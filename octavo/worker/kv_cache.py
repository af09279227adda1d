"""The paged KV cache tensors: sizing from the memory budget, allocation, block copies.

A quantized cache (int8 / fp8) costs head_dim + 4 bytes per token, KV head
and K or V (one byte per element, a float32 scale) against 2 * head_dim for
bf16: 1.88x the tokens in the same memory at head_dim 64, 1.94x at 128."""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Optional, Sequence

import torch

from octavo.attention.base import AttentionBackend
from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.kv_quant import copy_blocks as copy_layer_blocks
from octavo.attention.kv_spec import KVCacheSpec
from octavo.config import CacheConfig
from octavo.worker.memory import available_memory_bytes, check_pool_fits

logger = logging.getLogger(__name__)


def bytes_per_block(specs: Sequence[KVCacheSpec]) -> int:
    """What one block id costs across ``specs`` (one per cache tensor, of every model that shares the block ids)."""
    return sum(spec.bytes_per_block for spec in specs)


def num_cache_blocks(
    config: CacheConfig,
    specs: Sequence[KVCacheSpec],
    device: torch.device,
    max_useful_tokens: Optional[int] = None,
    memory_share: float = 1.0,
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
    ``specs``: every cache tensor's (one per layer, but one for the layers of
    several KV cache groups that share it), a draft model's included (its cache is indexed
    by the same block ids)."""
    per_block = bytes_per_block(specs)
    block_size = specs[0].block_size
    if config.num_blocks is not None:
        check_pool_fits(config.num_blocks * per_block, device, "num_blocks (--num-blocks)")
        return config.num_blocks
    budget = config.kv_cache_memory_bytes
    if budget is not None:
        budget = int(budget * memory_share)
        check_pool_fits(budget, device, "kv_cache_memory_bytes (--kv-cache-memory)")
    else:
        budget = int(available_memory_bytes(device) * config.memory_fraction * memory_share)
        if max_useful_tokens is not None:
            cap_blocks = 2 * -(-max_useful_tokens // block_size)
            budget = min(budget, cap_blocks * per_block)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is below one block ({per_block} bytes); "
            "raise kv_cache_memory_bytes or memory_fraction"
        )
    return blocks


def allocate_kv_caches(
    specs: Sequence[KVCacheSpec], backend: AttentionBackend, num_blocks: int, device: torch.device,
    static_scales: Optional[list[Optional[torch.Tensor]]] = None, padding_blocks: int = 0,
    slots: Optional[Sequence[int]] = None,
) -> list[LayerKVCache]:
    """One zero-filled cache per layer, from its spec, in ``backend``'s layout: ``num_blocks`` for
    the scheduler's pool plus ``padding_blocks`` after them that no request owns (recorded decode
    steps pad into one, sliding-window groups' released entries name one); ``static_scales``: per
    layer, the checkpoint's [2, kv_heads] K/V scales or None (quantized caches only). ``slots``:
    per layer, the tensor it shares with the other layers of that slot (KV cache groups,
    octavo/attention/kv_groups.py), each keeping its own static scales; default: a tensor each."""
    caches: list[LayerKVCache] = []
    first: dict[int, tuple[KVCacheSpec, LayerKVCache]] = {}
    for i, spec in enumerate(specs):
        scales = static_scales[i] if static_scales else None
        slot = slots[i] if slots is not None else i
        if slot not in first:
            first[slot] = spec, backend.allocate_cache(spec, num_blocks + padding_blocks, device, scales)
            caches.append(first[slot][1])
            continue
        owner, cache = first[slot]
        if spec.bytes_per_block != owner.bytes_per_block:
            raise ValueError(f"KV cache groups: layers sharing a cache tensor must keep the same bytes per block; "
                             f"got {owner.describe()} and {spec.describe()}")
        if scales is not None:
            scales = scales.to(device=device, dtype=torch.float32).contiguous()
        caches.append(dataclasses.replace(cache, static_scales=scales))
    owners = [spec for spec, _ in first.values()]
    kinds = Counter(spec.describe() for spec in specs)
    fixed = sum(c.static_scales is not None for c in caches)
    block_size = specs[0].block_size
    logger.info(
        # One short line (the start-up log keeps its lines under ~200 characters): dtypes without "torch.".
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB, %d bytes per token; %s%s%s",
        num_blocks, block_size, num_blocks * block_size, num_blocks * bytes_per_block(owners) / 2**20,
        bytes_per_block(owners) // block_size,
        "; ".join(f"{n} layer{'s' * (n > 1)} {kind}" for kind, n in kinds.items()).replace("torch.", ""),
        f"; static scales from the checkpoint in {fixed} layers" if fixed else "",
        f"; +{padding_blocks} padding block{'s' * (padding_blocks > 1)}" if padding_blocks else "",
    )
    return caches


def copy_blocks(kv_caches: list[LayerKVCache], copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: block dst gets block src's K/V (and scales) in every layer (once per tensor
    that layers share)."""
    if not copies:
        return
    device = kv_caches[0].data.device
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    for cache in {id(c.data): c for c in kv_caches}.values():
        copy_layer_blocks(cache, src, dst)
