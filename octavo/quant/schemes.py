"""The quantization scheme a ModelConfig asks for."""
from __future__ import annotations

import torch

from octavo.config import ModelConfig
from octavo.quant.base import QuantizationScheme
from octavo.quant.onthefly import OnTheFlyScheme
from octavo.quant.unquantized import UniformScheme, UnquantizedLinearMethod


def quantization_scheme(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> QuantizationScheme:
    """Unquantized layers use ``linear_backend``'s method (for weights of
    ``dtype`` on ``device``); ``quantization`` quantizes the others on the fly."""
    unquantized = UnquantizedLinearMethod.for_backend(config.linear_backend, device, dtype,
                                                         config.linear_weight_copies)
    if config.quantization is None:
        return UniformScheme(unquantized)
    return OnTheFlyScheme(config.quantization, config.quantization_group_size, config.unquantized_patterns,
                          unquantized, config.lm_head_format)
