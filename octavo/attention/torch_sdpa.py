"""Attention in plain torch ops: decodes gathered and batched into SDPA calls
by similar context length, prefill chunks one SDPA call each. Runs on any
device and dtype; the reference the native backend is tested against."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata, MaskByWindow, StepLayout
from octavo.attention.kv_quant import LayerKVCache, gather_blocks
from octavo.attention.prefill import attend, attend_prefills, build_prefills, window_mask


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
class TorchSdpaMetadata(AttentionMetadata):
    decode_groups: list[DecodeGroup]


def decode_groups(blocks_needed: list[int]) -> list[tuple[int, int]]:
    """Split rows sorted by descending length into runs whose shortest member
    needs at least half the blocks of the longest: padding then at most doubles
    the work, and a batch mixing 10- and 1000-token contexts no longer pads
    every row to 1000. Each group costs one more attention call per layer, so
    the halving rule keeps their number logarithmic in the length spread."""
    groups: list[tuple[int, int]] = []
    start = 0
    for row in range(1, len(blocks_needed) + 1):
        if row == len(blocks_needed) or 2 * blocks_needed[row] < blocks_needed[start]:
            groups.append((start, row))
            start = row
    return groups


class TorchSdpaBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, layout: StepLayout) -> TorchSdpaMetadata:
        groups = []
        for start, end in decode_groups(layout.blocks_needed[: layout.num_decodes]):
            width = layout.blocks_needed[start]  # rows are sorted longest first
            keys = torch.arange(width * layout.block_size, device=layout.device)
            context = torch.tensor(layout.context_lens[start:end], dtype=torch.int64, device=layout.device)
            query_pos = context.unsqueeze(1) - 1
            groups.append(DecodeGroup(
                row_start=start,
                row_end=end,
                block_table=layout.block_table[start:end, :width],
                masks={w: window_mask(query_pos, keys, w).view(end - start, 1, 1, -1) for w in self.windows},
            ))
        return TorchSdpaMetadata(layout.slot_mapping, layout.num_decodes, build_prefills(layout, self.windows), groups)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: TorchSdpaMetadata,
        window: Optional[int],
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            rows = slice(group.row_start, group.row_end)
            keys = gather_blocks(kv_cache, 0, group.block_table, q.dtype).transpose(1, 2)
            values = gather_blocks(kv_cache, 1, group.block_table, q.dtype).transpose(1, 2)
            o = attend(q[rows].unsqueeze(2), keys, values, group.masks[window], scale, softcap)
            out[rows] = o.squeeze(2)
        attend_prefills(q, k, v, kv_cache, meta.prefills, window, out, scale, softcap)
        return out
