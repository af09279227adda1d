"""Static K/V cache scales from a checkpoint: ``model.layers.N.self_attn.k_scale``
and ``.v_scale``, as llm-compressor and vLLM fp8 checkpoints store them (one
value per layer, or one per KV head). Each is an fp8 e4m3 dequantization
scale, ``x ~= fp8 * k_scale``: a calibrated range of +-448 * k_scale. An int8
cache maps the same range onto +-127.

The model loader skips these tensors (a bf16 cache has no use for them); the
worker reads them here when its cache is quantized."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from octavo.attention.kv_quant import QMAX
from octavo.model.loader import checkpoint_source
from octavo.model.models.causal_lm import CausalLM

SCALE_NAMES = ("k_scale", "v_scale")
FP8_MAX = QMAX[torch.float8_e4m3fn]


def load_static_kv_scales(
    net: CausalLM, folder: Path, cache_dtype: torch.dtype
) -> list[Optional[torch.Tensor]]:
    """Per local layer: [2, this rank's kv_heads] float32 quantization steps
    for a ``cache_dtype`` cache (K's, then V's), or None when the checkpoint
    has no scales for the layer or the layer keeps no K and V (latent
    attention). ValueError naming the tensor when one of the
    pair is missing, has a shape other than [1] / [num_kv_heads] / [], or
    is not a positive finite number."""
    stored = _read_scales(folder)
    first = net.model.layer_range.start
    result: list[Optional[torch.Tensor]] = []
    for offset, layer in enumerate(net.local_layers):
        prefix = f"model.layers.{first + offset}.self_attn."
        found = {name: stored.get(prefix + name) for name in SCALE_NAMES}
        qkv = getattr(layer.self_attn, "qkv_proj", None)
        if all(t is None for t in found.values()) or qkv is None:
            # A latent cache (DeepSeek) has no K and V to scale: its entries keep a scale per token.
            result.append(None)
            continue
        total_heads = qkv.num_kv_heads * qkv.num_kv_shards
        rows = []
        for name, tensor in found.items():
            if tensor is None:
                raise ValueError(f"checkpoint in {folder} has {prefix}{SCALE_NAMES[name == 'k_scale']} "
                                 f"but not {prefix}{name}")
            rows.append(_per_head(tensor.float().flatten(), total_heads, prefix + name))
        # This rank's KV heads: the shard QKVParallelLinear loads.
        shard = qkv.tp_rank * qkv.num_kv_shards // qkv.tp_size
        heads = slice(shard * qkv.num_kv_heads, (shard + 1) * qkv.num_kv_heads)
        result.append(torch.stack(rows)[:, heads] * (FP8_MAX / QMAX[cache_dtype]))
    return result


def _read_scales(folder: Path) -> dict[str, torch.Tensor]:
    source = checkpoint_source(folder)
    wanted = {n for n in source.names() if n.endswith(tuple(f"self_attn.{n}" for n in SCALE_NAMES))}
    return dict(source.tensors(wanted, "cpu"))


def _per_head(values: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    if values.numel() not in (1, heads):
        raise ValueError(f"{name} has {values.numel()} values; expected 1 or one per KV head ({heads})")
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ValueError(f"{name} must hold positive finite scales; got {values.tolist()}")
    return values.expand(heads)
