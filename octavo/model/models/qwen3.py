"""Qwen3: Llama's layers with an RMSNorm over each head of q and k before rotary; biases only where
config.json's attention_bias says; sliding windows as Qwen2 reads them."""
from __future__ import annotations

from octavo.model.config import ArchConfig
from octavo.model.layers.attention import AttentionOptions
from octavo.model.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    def attention_options(self, arch: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=arch.attention_bias, o_bias=arch.attention_bias, qk_norm=True)
