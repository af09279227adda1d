"""Bit fields in int32 words, the storage every pre-quantized format shares.

GPTQ, AWQ and compressed-tensors all store ``32 // bits`` small unsigned
integers per int32 word, the first one in the lowest bits; they differ in
the dim they pack along and, for AWQ, in which element goes to which field
(``order``). Unpacking is shifts and masks on whole tensors: no loop over
elements, so a 7B layer unpacks in milliseconds.
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
    """The unsigned ``bits``-wide fields of ``packed`` (int32) as an int32
    tensor ``pack_factor(bits)`` times longer along ``dim``.

    Word ``w``'s field ``f`` holds element ``w * pack + order[f]`` of that
    dim (``order`` None: element ``w * pack + f``)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensors must be int32, got {packed.dtype}")
    pack = pack_factor(bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    # [..., words, fields]: an arithmetic shift, so mask after it.
    fields = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        # Element e of a word sits in field order.index(e).
        fields = fields[..., _inverse(order)]
    return fields.reshape(*moved.shape[:-1], moved.shape[-1] * pack).movedim(-1, dim)


def _inverse(order: Sequence[int]) -> list[int]:
    inverse = [0] * len(order)
    for field, element in enumerate(order):
        inverse[element] = field
    return inverse
