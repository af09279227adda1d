"""Decode attention through Octavo's C kernel, which walks each sequence's
block table and reads K/V in place (no gather, no padding, no masks: the
kernel applies the window and the soft cap itself); prefill chunks through
torch's SDPA."""
from __future__ import annotations

from typing import ClassVar, Iterable, Optional

import torch

from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.paged import PagedDecodeBackend, PagedDecodeMetadata
from octavo.kernels import ops as native
from octavo.kernels.paged_decode import PagedDecodeKernel, paged_decode_kernel


class NativeCpuBackend(PagedDecodeBackend):
    name = "native"
    requirement = "runs on CPU with float32/bfloat16/float16 (caches also int8/fp8)"
    recorded_on: ClassVar[frozenset[str]] = frozenset({"cpu"})  # as kernel tapes

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

    def decode(self, q: torch.Tensor, kv_cache: LayerKVCache, meta: PagedDecodeMetadata, window: Optional[int],
               scale: float, softcap: Optional[float]) -> torch.Tensor:
        scales = kv_cache.scales
        return native.call(
            self.kernel, torch.ops.octavo.paged_decode, q, kv_cache.data[0], kv_cache.data[1],
            meta.decode_block_table, meta.decode_context_lens, window, scale,
            None if scales is None else scales[0], None if scales is None else scales[1], softcap,
        )
