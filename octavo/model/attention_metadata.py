"""What the attention layers need to know about one step, built once per step.

The step's tokens are flattened to ``[total_tokens, ...]`` with single-token
rows (decodes) first, then the multi-token chunks (prefills) in order. Masks are
built here per sliding window used by the model, so layers never rebuild them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from octavo.kernels.paged_decode import PagedDecodeKernel

# window (None = full attention) -> mask; True marks keys a query attends to.
MaskByWindow = dict[Optional[int], Optional[torch.Tensor]]


@dataclass
class PrefillChunk:
    """Rows ``q_start:q_end`` are positions ``context_len - (q_end - q_start)``
    .. ``context_len - 1`` of one request."""

    q_start: int
    q_end: int
    context_len: int
    # No cached prefix: attend over the step's own K/V and skip the cache read.
    fresh: bool
    block_ids: Optional[torch.Tensor]  # [blocks covering context_len]; None when fresh
    masks: MaskByWindow  # [q_len, context_len]; None = plain causal (fresh, full attention)


@dataclass
class DecodeGroup:
    """Decode rows ``row_start:row_end`` whose contexts are of similar length,
    so padding them to the longest one wastes little gather and attention work."""

    row_start: int
    row_end: int
    # [rows, max_blocks]: each decode's blocks, padded with block 0 (masked out).
    block_table: torch.Tensor
    masks: MaskByWindow  # [rows, 1, 1, max_blocks * block_size]


@dataclass
class PagedDecodes:
    """All decode rows in one call of the native kernel, which walks each
    row's block table itself: no padding, masks or groups needed."""

    block_table: torch.Tensor  # [num_decodes, max_blocks] int64, padded with block 0 (never read)
    context_lens: torch.Tensor  # [num_decodes] int64
    kernel: PagedDecodeKernel


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [total_tokens] int64: block_id * block_size + offset
    block_size: int
    num_decodes: int  # rows 0 .. num_decodes-1 are single-token queries
    # Decodes go either to the native kernel (paged_decodes) or, on the torch
    # path, through decode_groups.
    paged_decodes: Optional[PagedDecodes] = None
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
