"""Linear methods whose weight is a ``QuantizedWeight`` (octavo/quant/qweights.py)
or a ``W8A8Weight`` (octavo/quant/w8a8.py).

``QuantizedLinearMethod`` is the base every quantized format shares: its
``apply`` calls the layer's installed weight; a subclass only creates the
parameters its checkpoint (or the bf16 checkpoint, for on-the-fly
quantization) fills, and in ``process_weights_after_loading`` turns them into
canonical integers and calls ``install``.
"""
from __future__ import annotations

from abc import ABC
from typing import Optional, Union

import torch
from torch import nn

from octavo.quant.base import LinearMethod
from octavo.quant.qweights import QuantizedWeight
from octavo.quant.w8a8 import W8A8Weight


class QuantizedLinearMethod(LinearMethod, ABC):
    @staticmethod
    def install(layer: nn.Module, weight: Union[QuantizedWeight, W8A8Weight], loaded: tuple[str, ...]) -> None:
        """Make ``weight`` the layer's, and drop the parameters named in
        ``loaded`` (the checkpoint's tensors, now repacked): a meta tensor of
        the same shape keeps each name for the loader's bookkeeping, so no
        second copy of the weights stays behind."""
        layer.quant_weight = weight
        for name in loaded:
            old = getattr(layer, name)
            setattr(layer, name, nn.Parameter(old.detach().to("meta"), requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return layer.quant_weight(x, bias)

    def kernel_name(self, layer: nn.Module) -> str:
        return layer.quant_weight.kernel_name()

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.quant_weight.nbytes
