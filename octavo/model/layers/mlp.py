"""The gated feed-forward block (SwiGLU and friends)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels.fused_ops import FusedOps
from octavo.model.layers.linear import FusedLinear, Linear

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class GatedMLP(nn.Module):
    # The native kernels (set by ``use_fused_ops``); None: torch ops.
    fused: Optional[FusedOps] = None

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], ("gate_proj", "up_proj"), bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]
        self.is_silu = act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.is_silu:
            # SiLU and the product read the fused projection's output in one pass.
            return self.down_proj(self.fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(self.act(gate) * up)
