"""The kernel a pre-quantized layer runs, chosen from its unpacked integers.

Until the int8/int4 kernels serve a layer's layout, it is dequantized once
at load into the model's dtype and multiplied by torch: the same products
as the checkpoint's own dequantization, at bf16's cost.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from octavo.quant.formats.int_weight import IntWeight


class DequantizedKernel:
    """``x @ dequant(W).T`` with W dequantized once, input order restored."""

    name = "dequantized + torch matmul"

    def __init__(self, weight: IntWeight, dtype: torch.dtype) -> None:
        self.weight = weight.dequantize(dtype)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


def prepare_int_weight(weight: IntWeight, dtype: torch.dtype) -> DequantizedKernel:
    """The kernel for ``weight`` in a model of ``dtype``."""
    return DequantizedKernel(weight, dtype)
