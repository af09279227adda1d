"""Linear methods whose weight is a ``QuantizedWeight`` (octavo/quant/qweights.py)
or a ``W8A8Weight`` (octavo/quant/w8a8.py).

``QuantizedLinearMethod`` is the base every quantized format shares: its
``apply`` calls the layer's prepared weight; a subclass only creates the
parameters its checkpoint (or the bf16 checkpoint, for on-the-fly
quantization) fills, and in ``process_weights_after_loading`` turns them into
canonical integers and returns them through ``prepared``.
"""
from __future__ import annotations

from abc import ABC
from typing import Optional, Union

import torch
from torch import nn

from octavo.quant.base import LinearMethod, PreparedWeight
from octavo.quant.qweights import QuantizedWeight
from octavo.quant.w8a8 import W8A8Weight


class QuantizedLinearMethod(LinearMethod, ABC):
    @staticmethod
    def prepared(weight: Union[QuantizedWeight, W8A8Weight], loaded: tuple[str, ...]) -> PreparedWeight:
        """``weight`` for the kernels, the parameters named in ``loaded`` (the checkpoint's tensors,
        now repacked) released: no second copy of the weights stays behind."""
        return PreparedWeight(weight, released=loaded)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return layer.prepared(x, bias)

    def kernel_name(self, layer: nn.Module) -> str:
        return layer.prepared.kernel_name()

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.prepared.nbytes
