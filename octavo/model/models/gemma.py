"""Gemma 2 and Gemma 3: RMSNorms that scale by (1 + weight) in float32, embeddings times
sqrt(hidden_size), "sandwich" norms after attention and around the MLP, the softmax scale from
query_pre_attn_scalar, every N-th layer global and the others sliding; Gemma 3 adds q/k norms and
a rotary embedding of their own for the sliding layers."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from octavo.attention.base import AttentionMetadata
from octavo.attention.kv_quant import LayerKVCache
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig, ConfigReading
from octavo.model.layers.attention import Attention, AttentionOptions
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.norm import RMSNorm
from octavo.model.models.causal_lm import CausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends, attention: AttentionOptions) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(arch.hidden_size, arch.rms_norm_eps, backends.ops, unit_offset=True)

        prefix = f"model.layers.{layer_idx}"
        self.input_layernorm = norm()
        self.self_attn = Attention(arch, layer_idx, backends, f"{prefix}.self_attn", attention)
        # post_attention_layernorm normalises the attention output, pre_feedforward_layernorm the
        # MLP's input (adding the residual stream), post_feedforward_layernorm its output.
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, False, backends, f"{prefix}.mlp")
        # Gemma 3's sliding layers read the second rotary table.
        self.rope_index = int(arch.layer_rope(layer_idx) is not arch.rope)

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(CausalLM):
    sliding_pattern = 2  # every second layer is global where config.json has no layer_types

    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        return ConfigReading(sliding_window=True, sliding_pattern=cls.sliding_pattern, query_pre_attn_scalar=True)

    def attention_options(self, arch: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=arch.attention_bias, o_bias=arch.attention_bias, unit_offset_norm=True)

    def make_layer(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        return GemmaDecoderLayer(arch, layer_idx, backends, self.attention_options(arch))

    def make_norm(self, arch: ArchConfig, dim: int, backends: ModelBackends) -> RMSNorm:
        return RMSNorm(dim, arch.rms_norm_eps, backends.ops, unit_offset=True)

    def embed_scale(self, arch: ArchConfig) -> Optional[float]:
        return arch.hidden_size**0.5


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        return ConfigReading(sliding_window=True, sliding_pattern=int(raw.get("sliding_window_pattern") or 6),
                             query_pre_attn_scalar=True, local_rope=True)

    def attention_options(self, arch: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=arch.attention_bias, o_bias=arch.attention_bias, qk_norm=True,
                                unit_offset_norm=True)
