"""The model's linear layer: torch's, with bf16 weights prepacked for oneDNN on
CPU, and few-row products through Octavo's AMX kernel on those same bytes.

torch's bf16 CPU matmul reorders the weight into oneDNN's blocked layout on
every call. Packing each weight once at load time (``pack_weights``) skips
that: 1.3-2.2x faster products at every batch size on this project's CPUs,
the same results up to the summation order. For up to ``SMALL_ROWS`` rows
(decode at small batch: a pure weight read) the AMX kernel reads the packed
weight ~1.1-1.25x faster than oneDNN does (BENCHMARKS.md has the figures).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels.amx_linear import AmxLinearKernel, AmxWeight

# Batch size oneDNN picks the packed layout for; it serves 1 to 1000+ rows alike.
_PACK_HINT = 128
# Rows up to which the AMX kernel beats oneDNN on the same weights
# (benchmarks/linear_kernels.py: 1.25x at 1-16 rows, even at 128).
SMALL_ROWS = 64


class Linear(nn.Linear):
    packed: Optional[torch.Tensor] = None  # oneDNN's prepacked copy of the weight
    small_rows: Optional[AmxWeight] = None  # the AMX kernel over those bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_rows is not None and x.numel() <= SMALL_ROWS * x.shape[-1]:
            return self.small_rows(x, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several projections of the same input as one matmul (q/k/v, gate/up).

    Checkpoints store the parts under their own names (``q_proj``, ...); the
    loader stacks them in ``parts`` order, ``sizes`` output rows each."""

    def __init__(self, in_features: int, sizes: list[int], parts: tuple[str, ...], bias: bool) -> None:
        super().__init__(in_features, sum(sizes), bias=bias)
        if len(sizes) != len(parts):
            raise ValueError(f"{len(parts)} parts {parts} but {len(sizes)} sizes")
        self.sizes, self.parts = list(sizes), parts

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.sizes, dim=-1)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weights(model: nn.Module, amx: Optional[AmxLinearKernel] = None) -> int:
    """Pack every bf16 Linear weight of ``model`` for oneDNN; returns how many.
    With ``amx``, few-row products of each packed weight whose layout the
    kernel reads go to it.

    The plain weight is then dropped (kept as a meta tensor for its shape and
    dtype) unless another module shares it, like a tied embedding."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16 and module.packed is None:
            weight = module.weight.detach()
            module.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
            if amx is not None:
                module.small_rows = amx.share_onednn(module.packed, weight)
            if owners[id(module.weight)] == 1:
                module.weight = nn.Parameter(weight.to("meta"), requires_grad=False)
            count += 1
    return count
