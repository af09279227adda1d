"""What the backends whose decode kernel walks the block tables share: one kernel call for every
decode row (K/V read in place), prefill chunks through torch's SDPA (octavo/attention/prefill.py),
and metadata a recorded decode step can refill in place."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.prefill import attend_prefills, build_prefills


@dataclass
class PagedDecodeMetadata(AttentionMetadata):
    # All decode rows in one kernel call; None when the step has no decodes.
    decode_block_table: Optional[torch.Tensor]  # [num_decodes, max_blocks] int64, padded with block 0 (never read)
    decode_context_lens: Optional[torch.Tensor]  # [num_decodes], the backend's ``context_len_dtype``
    # The longest decode context (the CUDA kernel sizes its grid by it; a recording passes its capacity).
    max_decode_context: int


class PagedDecodeBackend(AttentionBackend):
    context_len_dtype: ClassVar[torch.dtype] = torch.int64

    @abstractmethod
    def decode(self, q: torch.Tensor, kv_cache: LayerKVCache, meta: PagedDecodeMetadata, window: Optional[int],
               scale: float, softcap: Optional[float]) -> torch.Tensor:
        """Attention of the decode rows q [num_decodes, heads, D] over their cached contexts."""

    def build_metadata(self, layout: StepLayout) -> PagedDecodeMetadata:
        """The decodes and every row of the short requests after them are decode rows: row j of a short
        request of q tokens over a context of c attends the c - q + 1 + j tokens up to its own, exactly
        as decoding that token would."""
        requests = layout.num_decodes + layout.num_short
        table = lens = None
        rows: list[int] = list(range(layout.num_decodes))  # the request of each decode row
        contexts = layout.context_lens[: layout.num_decodes]
        for i in range(layout.num_decodes, requests):
            q, c = layout.query_lens[i], layout.context_lens[i]
            rows += [i] * q
            contexts += range(c - q + 1, c + 1)
        if rows:
            width = max(layout.blocks_needed[:requests])
            table = layout.block_table[:requests, :width]
            if layout.num_short:
                table = table[torch.tensor(rows, device=layout.device)]
            lens = torch.tensor(contexts, dtype=self.context_len_dtype, device=layout.device)
        prefills = build_prefills(layout, self.windows, first=requests)
        return PagedDecodeMetadata(layout.slot_mapping, len(rows), prefills, table, lens, max(contexts, default=0))

    def static_decode_metadata(self, size: int, max_blocks: int, null_block: int, null_slot: int,
                               max_context: int, device: torch.device) -> PagedDecodeMetadata:
        return PagedDecodeMetadata(
            slot_mapping=torch.full((size,), null_slot, dtype=torch.int64, device=device),
            num_decodes=size,
            prefills=[],
            decode_block_table=torch.full((size, max_blocks), null_block, dtype=torch.int64, device=device),
            decode_context_lens=torch.ones(size, dtype=self.context_len_dtype, device=device),
            max_decode_context=max_context,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache,
                meta: PagedDecodeMetadata, window: Optional[int], scale: Optional[float] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        n = meta.num_decodes
        out = torch.empty_like(q) if meta.prefills or not n else None
        if n:
            o = self.decode(q[:n], kv_cache, meta, window, scale, softcap)
            if out is None:
                return o
            out[:n] = o
        attend_prefills(q, k, v, kv_cache, meta.prefills, window, out, scale, softcap)
        return out
