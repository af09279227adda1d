"""Qwen2: Llama's layers with q/k/v biases (none on o_proj or the MLP); a sliding window only where
config.json enables it (many checkpoints carry a sliding_window they do not use), from
max_window_layers on."""
from __future__ import annotations

from typing import Any

from octavo.model.config import ArchConfig, ConfigReading
from octavo.model.layers.attention import AttentionOptions
from octavo.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        return ConfigReading(sliding_window=bool(raw.get("use_sliding_window", False)))

    def attention_options(self, arch: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)

    def mlp_bias(self, arch: ArchConfig) -> bool:
        return False
