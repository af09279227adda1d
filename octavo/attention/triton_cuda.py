"""Attention on CUDA: decodes through the Triton paged kernel (one launch for all decode rows, K/V read in place
from the block table), prefill chunks through torch's SDPA (flash attention on CUDA), as on CPU."""
from __future__ import annotations

import importlib.util
from typing import ClassVar, Optional

import torch

from octavo.attention.kv_quant import QMAX, LayerKVCache
from octavo.attention.paged import PagedDecodeBackend, PagedDecodeMetadata

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class TritonBackend(PagedDecodeBackend):
    name = "triton"
    requirement = "runs on CUDA with the triton package (float32/bfloat16/float16, caches also int8/fp8)"
    recorded_on: ClassVar[frozenset[str]] = frozenset({"cuda"})  # as CUDA graphs
    context_len_dtype = torch.int32

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        return (device.type == "cuda" and dtype in _FLOATS and (cache_dtype in _FLOATS or cache_dtype in QMAX)
                and importlib.util.find_spec("triton") is not None)

    def decode(self, q: torch.Tensor, kv_cache: LayerKVCache, meta: PagedDecodeMetadata, window: Optional[int],
               scale: float, softcap: Optional[float]) -> torch.Tensor:
        # Imported here: importing triton costs a second, and only CUDA runs reach this.
        from octavo.kernels.triton_paged_decode import paged_decode

        scales = kv_cache.scales
        # The grid is sized for max_decode_context: one recording serves every context length.
        return paged_decode(
            q, kv_cache.data[0], kv_cache.data[1], meta.decode_block_table, meta.decode_context_lens,
            meta.max_decode_context, scale, window, softcap,
            key_scales=None if scales is None else scales[0], value_scales=None if scales is None else scales[1],
        )
