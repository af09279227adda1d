"""The kernels a model is built with, chosen once by the worker from the
config and the device (``octavo/worker/model_runner.py``), handed to every
layer at construction: no module attribute is switched after loading."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from octavo.attention.base import AttentionBackend
from octavo.attention.torch_sdpa import TorchSdpaBackend
from octavo.kernels.fused_ops import FusedOps
from octavo.quant.base import LinearMethod, QuantizationScheme
from octavo.quant.unquantized import UniformScheme


@dataclass(frozen=True)
class ModelBackends:
    # Every linear layer's weights and products (the lm_head's included),
    # chosen per layer by its checkpoint module path.
    quantization: QuantizationScheme = field(default_factory=UniformScheme)
    # Attention over the paged cache; its windows must cover the model's layers'.
    attention: AttentionBackend = field(default_factory=lambda: TorchSdpaBackend({None}))
    # Native RMSNorm (+ residual), SiLU-and-multiply and rotary + K/V write;
    # None: torch ops (the same values).
    fused_ops: Optional[FusedOps] = None

    def linear_method(self, prefix: str) -> LinearMethod:
        """The method of the linear layer at ``prefix`` (e.g. ``lm_head``)."""
        return self.quantization.linear_method(prefix)
