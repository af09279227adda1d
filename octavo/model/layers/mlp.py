"""The gated feed-forward block (SwiGLU and friends): gate/up column-parallel,
down row-parallel, so a tensor-parallel MLP needs one all-reduce."""
from __future__ import annotations

import torch
from torch import nn

from octavo.model.backends import ModelBackends
from octavo.model.layers.elementwise import ACTIVATIONS
from octavo.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, backends: ModelBackends,
                 prefix: str) -> None:
        """``prefix``: the block's module path (``model.layers.0.mlp``)."""
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias,
                                                       backends.linear_method(gate_up), gate_up)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, backends.linear_method(down), down)
        self.act = act
        self.ops = backends.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gated_activation(self.gate_up_proj(x), self.act))
