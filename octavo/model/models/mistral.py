"""Mistral: Llama's layers without biases, a sliding window on every layer when config.json sets one."""
from __future__ import annotations

from typing import Any

from octavo.model.config import ArchConfig, ConfigReading
from octavo.model.layers.attention import AttentionOptions
from octavo.model.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        return ConfigReading(sliding_window=raw.get("sliding_window") is not None)

    def attention_options(self, arch: ArchConfig) -> AttentionOptions:
        return AttentionOptions()

    def mlp_bias(self, arch: ArchConfig) -> bool:
        return False
