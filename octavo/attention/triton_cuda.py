"""Attention on CUDA: decodes through the Triton paged kernel (one launch for all decode rows, K/V read in place
from the block table), prefill chunks through torch's SDPA (flash attention on CUDA), as on CPU."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from octavo.attention.kv_quant import QMAX, LayerKVCache
from octavo.attention.prefill import attend_prefills, build_prefills

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class TritonMetadata(AttentionMetadata):
    decode_block_table: Optional[torch.Tensor]  # [num_decodes, max_blocks], padded with block 0 (never read)
    decode_context_lens: Optional[torch.Tensor]  # [num_decodes] int32
    # Sizes the kernel's grid (its partitions of the context); a CUDA graph passes the capacity it was captured for.
    max_decode_context: int


class TritonBackend(AttentionBackend):
    name = "triton"
    requirement = "runs on CUDA with the triton package (float32/bfloat16/float16, caches also int8/fp8)"

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        return (device.type == "cuda" and dtype in _FLOATS and (cache_dtype in _FLOATS or cache_dtype in QMAX)
                and importlib.util.find_spec("triton") is not None)

    def build_metadata(self, layout: StepLayout) -> TritonMetadata:
        n = layout.num_decodes
        table = lens = None
        longest = 0
        if n:
            longest = layout.context_lens[0]  # decodes come longest first
            table = layout.block_table[:n, : layout.blocks_needed[0]]
            lens = torch.tensor(layout.context_lens[:n], dtype=torch.int32, device=layout.device)
        return TritonMetadata(layout.slot_mapping, n, build_prefills(layout, self.windows), table, lens, longest)

    def static_decode_metadata(self, size: int, max_blocks: int, null_block: int, null_slot: int,
                               max_context: int, device: torch.device) -> TritonMetadata:
        # The grid is sized for max_context: one recording serves every context length.
        return TritonMetadata(
            slot_mapping=torch.full((size,), null_slot, dtype=torch.int64, device=device),
            num_decodes=size,
            prefills=[],
            decode_block_table=torch.full((size, max_blocks), null_block, dtype=torch.int64, device=device),
            decode_context_lens=torch.ones(size, dtype=torch.int32, device=device),
            max_decode_context=max_context,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: TritonMetadata,
        window: Optional[int],
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        # Imported here: importing triton costs a second, and only CUDA runs reach this.
        from octavo.kernels.triton_paged_decode import paged_decode

        scale = q.shape[-1] ** -0.5 if scale is None else scale
        n = meta.num_decodes
        out = torch.empty_like(q) if meta.prefills or not n else None
        if n:
            scales = kv_cache.scales
            o = paged_decode(
                q[:n], kv_cache.data[0], kv_cache.data[1], meta.decode_block_table, meta.decode_context_lens,
                meta.max_decode_context, scale, window, softcap,
                key_scales=None if scales is None else scales[0], value_scales=None if scales is None else scales[1],
            )
            if out is None:
                return o
            out[:n] = o
        attend_prefills(q, k, v, kv_cache, meta.prefills, window, out, scale, softcap)
        return out
