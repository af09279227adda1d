"""A layer's paged KV cache, plain or quantized, and the torch form of its
quantization (the reference the native kernels match, and the path on
devices they do not serve).

Quantized caches (``kv_cache_dtype`` int8 or fp8 = float8_e4m3fn) store one
byte per element and a float32 scale per (token, KV head), symmetric:
``x ~= q * scale``. The scale of a row is ``max|x| / QMAX`` (127 for int8,
448 for e4m3) unless the checkpoint gave the layer static per-head scales
(``k_scale``/``v_scale``), which then serve every token.

Scales are laid out ``[2, num_blocks, kv_heads, block_size]``: the decode
kernel scores 16 positions of one head at a time and reads their 16 scales
with one vector load; float32 because the kernel multiplies in float32 and a
narrower scale would save 2 bytes of 66-132 per token and head (head_dim 64
-128) at the cost of a conversion per load.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from octavo.kernels import huge_pages

# kv_cache_dtype -> storage dtype.
KV_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Largest magnitude a stored element takes: int8 is kept symmetric (no -128),
# e4m3fn's largest finite value is 448.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4  # float32, per token and KV head


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Quantized values as uint8 for the index ops, which torch lacks for
    float8 on CPU; a float tensor unchanged."""
    return t.view(torch.uint8) if is_quantized(t.dtype) else t


@dataclass
class LayerKVCache:
    """One layer's K and V blocks: ``data`` ``[2, num_blocks, block_size,
    kv_heads, head_dim]`` (K then V; a latent cache: ``[1, ...]``, one vector
    per token); for a quantized cache ``scales``
    ``[2, num_blocks, kv_heads, block_size]`` float32 and, when the checkpoint
    provides them, ``static_scales`` ``[2, kv_heads]`` float32 (the step of K
    and of V per head, used instead of each row's own). ``key_bounds`` (sparse
    attention, octavo/attention/quest.py) ``[kv_heads, num_blocks, 2, head_dim]``:
    the elementwise minimum and maximum of each block's keys as stored, in
    ``bounds_dtype``; heads first (blocks on dim 1, as every cache tensor keeps
    them), so the blocks of a table gathered are each head's [pages, 2 x
    head_dim] matrix for one product, with no copy."""

    data: torch.Tensor
    scales: Optional[torch.Tensor] = None
    static_scales: Optional[torch.Tensor] = None
    key_bounds: Optional[torch.Tensor] = None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def block_size(self) -> int:
        return self.data.shape[2]

    def slots(self) -> torch.Tensor:
        """``data`` as ``[2, num_blocks * block_size, kv_heads, head_dim]`` (``[1, ...]``: latent)."""
        return self.data.view(self.data.shape[0], -1, self.data.shape[-2], self.data.shape[-1])


def bounds_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a cache of ``dtype`` keeps its key bounds in: its own float dtype (a minimum or maximum of
    stored values is a stored value, so nothing is rounded), float32 for a quantized one (its keys are
    values times float32 scales)."""
    return torch.float32 if is_quantized(dtype) else dtype


def allocate_layer_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    static_scales: Optional[torch.Tensor] = None, parts: int = 2, key_bounds: bool = False,
) -> LayerKVCache:
    """``parts``: vectors per token and head (K and V: 2; a latent: 1);
    ``key_bounds``: also keep each block's key bounds (sparse attention).
    Zero-filled: padded slots of a gathered block are masked out of
    attention, but a NaN bit pattern left in fresh memory would still poison
    the weighted sum (0 * NaN). Scales start at 1 for the same reason. On
    huge pages where the OS gives them: the decode kernels read blocks at
    scattered places (octavo/kernels/huge_pages.py)."""
    data = huge_pages.zeros((parts, num_blocks, block_size, kv_heads, head_dim), dtype, torch.device(device))
    bounds = (torch.zeros(kv_heads, num_blocks, 2, head_dim, dtype=bounds_dtype(dtype), device=device)
              if key_bounds else None)
    if not is_quantized(dtype):
        return LayerKVCache(data, key_bounds=bounds)
    scales = torch.ones(parts, num_blocks, kv_heads, block_size, dtype=torch.float32, device=device)
    if static_scales is not None:
        static_scales = static_scales.to(device=device, dtype=torch.float32).contiguous()
    return LayerKVCache(data, scales, static_scales, bounds)


def quantize(x: torch.Tensor, dtype: torch.dtype, static: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (values [T, H, D] of ``dtype``, scales [T, H] float32)
    with x ~= values * scales. ``static`` [H]: fixed per-head scales (values
    beyond their range saturate)."""
    qmax = QMAX[dtype]
    xf = x.float()
    if static is None:
        scales = xf.abs().amax(dim=-1) / qmax
        # An all-zero row: any scale stores it exactly; 1 avoids 0 / 0.
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    else:
        scales = static.to(xf.device).expand(x.shape[0], -1).contiguous()
    scaled = (xf / scales.unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., H, D], scales [..., H] -> [..., H, D] of ``dtype``."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def write_kv(cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] into their slots (``write_vectors``)."""
    write_vectors(cache, (k, v), slot_mapping)


def write_vectors(cache: LayerKVCache, vectors: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor) -> None:
    """Each of ``vectors`` [T, kv_heads, D] (K and V, or a latent cache's one) into its part's slots: cast
    when the cache holds another float dtype (a no-op otherwise), quantized into a quantized one."""
    slots = cache.slots()
    if not cache.quantized:
        for i, x in enumerate(vectors):
            slots[i].index_copy_(0, slot_mapping, x.to(cache.dtype))
        return
    block, offset = slot_mapping // cache.block_size, slot_mapping % cache.block_size
    for i, x in enumerate(vectors):
        static = None if cache.static_scales is None else cache.static_scales[i]
        values, scales = quantize(x, cache.dtype, static)
        _as_bytes(slots[i]).index_copy_(0, slot_mapping, _as_bytes(values))
        cache.scales[i][block, :, offset] = scales


def read_slots(cache: LayerKVCache, which: int, slot_mapping: torch.Tensor) -> torch.Tensor:
    """K (``which`` 0) or V (1) of the slots ``slot_mapping`` [T] as stored: ``[T, kv_heads, head_dim]`` in the
    cache's dtype, or dequantized to float32 from a quantized cache (as the decode kernels read them)."""
    values = _as_bytes(cache.slots()[which]).index_select(0, slot_mapping).view(cache.dtype)
    if not cache.quantized:
        return values
    block, offset = slot_mapping // cache.block_size, slot_mapping % cache.block_size
    return dequantize(values, cache.scales[which][block, :, offset], torch.float32)


def gather_blocks(cache: LayerKVCache, which: int, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (``which`` 0) or V (1) of ``block_ids`` [...] in ``dtype``:
    ``[..., blocks * block_size, kv_heads, head_dim]``, dequantized."""
    ids = block_ids.reshape(-1)
    blocks = _as_bytes(cache.data[which]).index_select(0, ids).view(cache.dtype)
    if cache.quantized:
        scales = cache.scales[which].index_select(0, ids).transpose(1, 2)  # [n, block_size, H]
        blocks = dequantize(blocks, scales, dtype)
    else:
        blocks = blocks.to(dtype)
    return blocks.view(*block_ids.shape[:-1], -1, cache.data.shape[-2], cache.data.shape[-1])


def copy_blocks(cache: LayerKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Blocks ``dst`` get blocks ``src``'s K/V (and their scales and key bounds)."""
    data = _as_bytes(cache.data)
    data.index_copy_(1, dst, data.index_select(1, src))
    for extra in (cache.scales, cache.key_bounds):
        if extra is not None:
            extra.index_copy_(1, dst, extra.index_select(1, src))
