"""Llama, and the pre-norm decoder layer that Mistral, Qwen2, Qwen3 and Phi-3 reuse: attention
then a gated MLP, each behind an RMSNorm that also adds the residual stream."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from octavo.attention.base import AttentionMetadata
from octavo.attention.kv_quant import LayerKVCache
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig
from octavo.model.layers.attention import Attention, AttentionOptions
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.norm import RMSNorm
from octavo.model.models.causal_lm import CausalLM


class PreNormDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, backends: ModelBackends, self_attn: nn.Module, mlp: nn.Module) -> None:
        """``self_attn``: the attention block the family chose (``Attention``; DeepSeek's latent one);
        ``mlp``: its feed-forward block (gated dense; a mixture of experts)."""
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backends.ops)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backends.ops)
        self.mlp = mlp
        self.rope_index = 0

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends, attention: AttentionOptions,
                 mlp: nn.Module) -> None:
        super().__init__(arch, backends,
                         Attention(arch, layer_idx, backends, f"model.layers.{layer_idx}.self_attn", attention), mlp)


class LlamaForCausalLM(CausalLM):
    def attention_options(self, arch: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=arch.attention_bias, o_bias=arch.attention_bias)

    def mlp_bias(self, arch: ArchConfig) -> bool:
        return arch.mlp_bias

    def make_mlp(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        """The layer's feed-forward block: dense and gated here; a family with experts returns its own."""
        return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, self.mlp_bias(arch), backends,
                        f"model.layers.{layer_idx}.mlp")

    def make_layer(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        return LlamaDecoderLayer(arch, layer_idx, backends, self.attention_options(arch),
                                 self.make_mlp(arch, layer_idx, backends))
