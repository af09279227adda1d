"""Decode attention through Octavo's C kernel, which walks each sequence's
block table and reads K/V in place (no gather, no padding, no masks: the
kernel applies the window and the soft cap itself); prefill chunks through
torch's SDPA."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.prefill import attend_prefills, build_prefills
from octavo.kernels import ops as native
from octavo.kernels.paged_decode import PagedDecodeKernel, paged_decode_kernel


@dataclass
class NativeCpuMetadata(AttentionMetadata):
    # All decode rows in one kernel call; None when the step has no decodes.
    decode_block_table: Optional[torch.Tensor]  # [num_decodes, max_blocks] int64, padded with block 0 (never read)
    decode_context_lens: Optional[torch.Tensor]  # [num_decodes] int64


class NativeCpuBackend(AttentionBackend):
    name = "native"
    requirement = "runs on CPU with float32/bfloat16/float16 (caches also int8/fp8)"

    def __init__(self, windows: Iterable[Optional[int]], kernel: PagedDecodeKernel) -> None:
        super().__init__(windows)
        self.kernel = kernel

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        return PagedDecodeKernel.supports(device, dtype, cache_dtype)

    @classmethod
    def create(cls, windows: Iterable[Optional[int]], required: bool) -> Optional[NativeCpuBackend]:
        kernel = paged_decode_kernel(required=required)
        return None if kernel is None else cls(windows, kernel)

    def build_metadata(self, layout: StepLayout) -> NativeCpuMetadata:
        n = layout.num_decodes
        table = lens = None
        if n:
            table = layout.block_table[:n, : layout.blocks_needed[0]]  # decodes sorted longest first
            lens = torch.tensor(layout.context_lens[:n], dtype=torch.int64, device=layout.device)
        return NativeCpuMetadata(layout.slot_mapping, n, build_prefills(layout, self.windows), table, lens)

    def static_decode_metadata(self, size: int, max_blocks: int, null_block: int, null_slot: int,
                               max_context: int, device: torch.device) -> NativeCpuMetadata:
        return NativeCpuMetadata(
            slot_mapping=torch.full((size,), null_slot, dtype=torch.int64, device=device),
            num_decodes=size,
            prefills=[],
            decode_block_table=torch.full((size, max_blocks), null_block, dtype=torch.int64, device=device),
            decode_context_lens=torch.ones(size, dtype=torch.int64, device=device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: NativeCpuMetadata,
        window: Optional[int],
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        n = meta.num_decodes
        if not n:
            out = torch.empty_like(q)
        else:
            scales = kv_cache.scales
            o = native.call(
                self.kernel, torch.ops.octavo.paged_decode, q[:n], kv_cache.data[0], kv_cache.data[1], meta.decode_block_table, meta.decode_context_lens, window,
                scale, None if scales is None else scales[0], None if scales is None else scales[1], softcap,
            )
            if not meta.prefills:
                return o
            out = torch.empty_like(q)
            out[:n] = o
        attend_prefills(q, k, v, kv_cache, meta.prefills, window, out, scale, softcap)
        return out
