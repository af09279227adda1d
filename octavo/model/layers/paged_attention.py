"""Attention over a paged KV cache, in plain torch ops.

Each layer's cache is one tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``
(K then V). New K/V are written by slot. Decodes go to the native kernel,
which reads their blocks in place, when the step has one; otherwise reads
gather only the blocks a request needs, and decodes of similar context length
are batched into one SDPA call each (padded to the group's longest context and
masked). Each prefill chunk gets its own SDPA call with an offset causal mask.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from octavo.model.attention_metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] into their slots (cast when the cache
    dtype differs from the model's; a no-op otherwise)."""
    slots = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    slots[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_ids [...] -> [..., blocks * block_size, H, D]."""
    blocks = cache.index_select(0, block_ids.reshape(-1)).to(dtype)
    return blocks.view(*block_ids.shape[:-1], -1, cache.shape[-2], cache.shape[-1])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: Optional[int],
) -> torch.Tensor:
    """q [T, heads, D]; k, v [T, kv_heads, D] already written to ``kv_cache``.
    Returns [T, heads, D]."""
    decodes = meta.paged_decodes
    if decodes is not None:
        n = meta.num_decodes
        o = decodes.kernel(
            q[:n], kv_cache[0], kv_cache[1], decodes.block_table, decodes.context_lens, window, q.shape[-1] ** -0.5
        )
        if not meta.prefills:
            return o
        out = torch.empty_like(q)
        out[:n] = o
    else:
        out = torch.empty_like(q)
    for group in meta.decode_groups:
        rows = slice(group.row_start, group.row_end)
        keys = _gather(kv_cache[0], group.block_table, q.dtype).transpose(1, 2)
        values = _gather(kv_cache[1], group.block_table, q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2), keys, values, attn_mask=group.masks[window], enable_gqa=True
        )
        out[rows] = o.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_end)
        if chunk.fresh:
            keys, values = k[rows], v[rows]
        else:
            keys = _gather(kv_cache[0], chunk.block_ids, q.dtype)[: chunk.context_len]
            values = _gather(kv_cache[1], chunk.block_ids, q.dtype)[: chunk.context_len]
        mask = chunk.masks[window]
        # 4-D inputs: torch's CPU flash kernel takes only those (3-D ones go
        # to the unfused math path: 6x slower on a 64-request offline run).
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
