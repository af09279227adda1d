"""The gated feed-forward block (SwiGLU and friends)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from octavo.model.layers.linear import FusedLinear, Linear

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], ("gate_proj", "up_proj"), bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(self.act(gate) * up)
