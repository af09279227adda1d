"""RMSNorm with the reference rounding: normalise in float32, scale in the
model dtype (Llama), or scale by (1 + weight) in float32 and round once
(Gemma: ``unit_offset``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from octavo.model.layers.elementwise import TORCH_OPS, ElementwiseOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: ElementwiseOps = TORCH_OPS, unit_offset: bool = False) -> None:
        """``ops``: the model's elementwise implementations. ``unit_offset``: the weight is stored
        minus one (Gemma)."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and
        the next norm in one pass. ``residual`` may be updated in place; None
        (the first layer's input): (norm(x), x)."""
        if residual is None:
            return self(x), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
