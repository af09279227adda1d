"""The gated feed-forward block (SwiGLU and friends): gate/up column-parallel,
down row-parallel, so a tensor-parallel MLP needs one all-reduce."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels import ops as native
from octavo.model.backends import ModelBackends
from octavo.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, backends: ModelBackends,
                 prefix: str) -> None:
        """``prefix``: the block's module path (``model.layers.0.mlp``)."""
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias,
                                                       backends.linear_method(gate_up), gate_up)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, backends.linear_method(down), down)
        self.act = _ACTIVATIONS[act]
        # The native kernel reads the fused projection's output once for SiLU and the product.
        self.ops = backends.fused_ops if act in ("silu", "swish") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.down_proj(native.call(self.ops.silu_mul, torch.ops.octavo.silu_mul, gate_up))
        gate, up = gate_up.split(self.gate_up_proj.output_sizes, dim=-1)
        return self.down_proj(self.act(gate) * up)
