"""An unpacked pre-quantized layer (``IntWeight``) as the int8/int4 kernels
take it (octavo/quant/qweights.py's canonical form).

Both keep the checkpoint's integers, scales and zero points (as float
zero points, so a GPTQ v1 zero of 16 is fine) and the act-order
permutation. One case has no group-wise kernel: a layer whose act-order
groups are split between tensor-parallel ranks (one group per column). It
is dequantized once at load and multiplied by torch.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch.nn import functional as F

from octavo.quant.formats.int_weight import IntWeight
from octavo.quant.qweights import Int4Weight, QuantizedWeight
from octavo.quant.w8a8 import W8A8Weight


class DequantizedWeight:
    """``F.linear`` on the weight dequantized once, in the input features' order."""

    def __init__(self, weight: IntWeight, dtype: torch.dtype) -> None:
        self.weight = weight.dequantize(dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def kernel_name(self) -> str:
        return "dequantized + F.linear (groups split between ranks)"

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


# What the kernels multiply a pre-quantized layer (or one expert's projections) by.
KernelWeight = Union[QuantizedWeight, DequantizedWeight, W8A8Weight]


def kernel_weight(weight: IntWeight, dtype: torch.dtype, int8_activations: bool = False) -> KernelWeight:
    """The weight a kernel multiplies by, for a model computing in ``dtype``;
    ``int8_activations``: a W8A8 layer (int8 per-channel symmetric weights,
    as the checkpoint's config was checked to say)."""
    if weight.group_size == 1 and not int8_activations:
        return DequantizedWeight(weight, dtype)
    q, scales = weight.q.contiguous(), weight.scales.float()
    if weight.mins is not None:  # an offset per group (GGUF Q4_1), as the kernels take it
        if weight.bits != 4:
            raise ValueError("offsets per group (mins) are only read for 4-bit weights")
        return Int4Weight(q, scales, None, weight.group_size, weight.perm, mins=weight.mins)
    zeros = weight.zeros.float()
    if weight.bits == 4:
        return Int4Weight(q, scales, zeros, weight.group_size, weight.perm)
    # int8 kernels read signed values: the unsigned ones less 128 (the same
    # bits, flipped top bit), their zero points too.
    signed = (q ^ 0x80).view(torch.int8)
    if int8_activations:
        return W8A8Weight(signed, scales[:, 0])
    signed_zeros = None if weight.symmetric_zero is not None else zeros - 128
    return QuantizedWeight(signed, 8, scales, signed_zeros, weight.group_size, weight.perm)

