"""RMSNorm with the reference rounding: normalise in float32, scale in the
model dtype (Llama), or scale by (1 + weight) in float32 and round once
(Gemma: ``unit_offset``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels import ops as native
from octavo.kernels.fused_ops import FusedOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Optional[FusedOps] = None, unit_offset: bool = False) -> None:
        """``ops``: the native kernels; None: torch ops. ``unit_offset``: the
        weight is stored minus one (Gemma); the native kernel rounds the
        Llama way, so torch ops run then."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset
        self.ops = None if unit_offset else ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.is_contiguous():
            return native.call(self.ops.rms_norm, torch.ops.octavo.rms_norm, x, self.weight, self.eps, None)
        return self._torch(x)

    def add_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and
        the next norm in one pass. ``residual`` may be updated in place; None
        (the first layer's input): (norm(x), x)."""
        if residual is None:
            return self(x), x
        if self.ops is not None and x.is_contiguous() and residual.is_contiguous():
            out = native.call(self.ops.rms_norm, torch.ops.octavo.rms_norm, x, self.weight, self.eps, residual)
            return out, residual
        residual = x + residual
        return self._torch(residual), residual

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel on the float32 copy: the same values as
        # x * rsqrt(mean(x^2) + eps) step by step, 1.75x faster on CPU.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)
