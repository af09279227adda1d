"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's layers without biases; checkpoints store qkv_proj and
gate_up_proj fused (split into their parts on load); rotary may turn a leading part of each head
only (partial_rotary_factor); a sliding window where config.json sets one."""
from __future__ import annotations

from typing import Any

from octavo.model.config import ArchConfig, ConfigReading
from octavo.model.layers.attention import AttentionOptions
from octavo.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    fused_checkpoint = True

    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        return ConfigReading(sliding_window=raw.get("sliding_window") is not None, partial_rotary=True)

    def attention_options(self, arch: ArchConfig) -> AttentionOptions:
        return AttentionOptions()

    def mlp_bias(self, arch: ArchConfig) -> bool:
        return False
