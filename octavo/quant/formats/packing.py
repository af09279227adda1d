"""Bit fields in int32 words, the storage every pre-quantized format shares.

GPTQ, AWQ and compressed-tensors all store ``32 // bits`` small unsigned
integers per int32 word, the first one in the lowest bits; they differ in
the dim they pack along and, for AWQ, in which element goes to which field
(``order``). Unpacking is one shift and mask per field on the whole
tensor, never a loop over elements.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

SUPPORTED_BITS = (4, 8)


def pack_factor(bits: int) -> int:
    """Values per int32 word."""
    return 32 // bits


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """The unsigned ``bits``-wide fields of ``packed`` (int32) as a uint8
    tensor ``pack_factor(bits)`` times longer along ``dim``.

    Word ``w``'s field ``f`` holds element ``w * pack + order[f]`` of that
    dim (``order`` None: element ``w * pack + f``)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensors must be int32, got {packed.dtype}")
    pack, mask = pack_factor(bits), (1 << bits) - 1
    dim %= packed.dim()
    # The fields get their own axis right after ``dim``: reading ``packed``
    # in its own order (one whole-tensor shift and mask per field; the shift
    # is arithmetic, so mask after it), the result is contiguous.
    out = torch.empty(*packed.shape[: dim + 1], pack, *packed.shape[dim + 1:], dtype=torch.uint8,
                      device=packed.device)
    for field in range(pack):
        out.select(dim + 1, field if order is None else order[field]).copy_((packed >> (bits * field)) & mask)
    return out.flatten(dim, dim + 1)
