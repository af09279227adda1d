"""Qwen3-MoE: Qwen3's layers (q/k norms) whose MLPs are mixtures of experts as Qwen2-MoE reads them,
without a shared expert."""
from __future__ import annotations

from typing import Any

from torch import nn

from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig, ConfigReading
from octavo.model.layers.moe import SparseMoEBlock
from octavo.model.models.qwen2_moe import qwen_experts
from octavo.model.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        base = super().config_reading(raw)
        return ConfigReading(sliding_window=base.sliding_window, experts=qwen_experts(raw, shared=False))

    def make_mlp(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        if layer_idx in arch.experts.dense_layers:
            return super().make_mlp(arch, layer_idx, backends)
        return SparseMoEBlock(arch, backends, f"model.layers.{layer_idx}.mlp", ("gate_proj", "up_proj", "down_proj"))
