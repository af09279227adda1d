"""The kernels a model runs with, chosen from the config for its device and
dtypes: one choice for the target model and for a draft model alike."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from octavo.attention.quest import QuestBackend
from octavo.attention.registry import select_attention_backend
from octavo.config import ModelConfig
from octavo.kernels.fused_ops import FusedOps, fused_ops
from octavo.model.layers.elementwise import TORCH_OPS, NativeElementwiseOps
from octavo.model.backends import ModelBackends
from octavo.quant.schemes import quantization_scheme


def model_backends(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    windows: Iterable[Optional[int]],
) -> ModelBackends:
    """Quantization scheme (linear method per layer), attention backend and fused ops for a model of ``dtype``
    with a KV cache of ``cache_dtype``; ``windows``: its layers' sliding windows."""
    kernels = fused_ops() if config.fused_ops and FusedOps.supports(device, dtype) else None
    attention = select_attention_backend(config.attention_backend, device, dtype, cache_dtype, set(windows))
    if config.sparse_attention == "quest":
        attention = QuestBackend(attention, config.sparse_top_pages, config.sparse_recent_pages)
    return ModelBackends(
        quantization=quantization_scheme(config, device, dtype),
        attention=attention,
        ops=TORCH_OPS if kernels is None else NativeElementwiseOps(kernels),
        quantized_activations=config.quantized_activations,
    )
