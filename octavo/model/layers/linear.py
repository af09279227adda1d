"""The model's linear layer: torch's, except few-row bf16 products on CPU.

Decoding a handful of sequences multiplies a few rows by every weight matrix:
torch's bf16 CPU matmul reads the weights there at a third to a half of the
memory bandwidth, the native kernel at nearly all of it (BENCHMARKS.md). The
model runner hands the kernel to each layer (``use_gemv``) when it builds.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels.bf16_gemv import Bf16Gemv


class Linear(nn.Linear):
    gemv: Optional[Bf16Gemv] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = self.gemv
        if gemv is not None and gemv.accepts(x, self.weight):
            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_gemv(model: nn.Module, gemv: Optional[Bf16Gemv]) -> None:
    """Route every Linear of ``model`` through ``gemv`` (None: torch only)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.gemv = gemv
