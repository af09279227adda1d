"""The kernels a model is built with, chosen once by the worker from the
config and the device (``octavo/worker/model_runner.py``), handed to every
layer at construction: no module attribute is switched after loading."""
from __future__ import annotations

from dataclasses import dataclass, field

from octavo.attention.base import AttentionBackend
from octavo.attention.torch_sdpa import TorchSdpaBackend
from octavo.model.layers.elementwise import TORCH_OPS, ElementwiseOps
from octavo.quant.base import LinearMethod, QuantizationScheme
from octavo.quant.unquantized import UniformScheme


@dataclass(frozen=True)
class ModelBackends:
    # Every linear layer's weights and products (the lm_head's included),
    # chosen per layer by its checkpoint module path.
    quantization: QuantizationScheme = field(default_factory=UniformScheme)
    # Attention over the paged cache; its windows must cover the model's layers'.
    attention: AttentionBackend = field(default_factory=lambda: TorchSdpaBackend({None}))
    # RMSNorm (+ residual), the gated activation, rotary (+ K/V write), argmax: torch or native.
    ops: ElementwiseOps = TORCH_OPS
    # int8/int4 weights at few rows: rows rounded to int8 (Q8_0 blocks) or kept float (octavo/quant/qweights.py).
    quantized_activations: str = "int8"

    def linear_method(self, prefix: str) -> LinearMethod:
        """The method of the linear layer at ``prefix`` (e.g. ``lm_head``)."""
        return self.quantization.linear_method(prefix)
