"""Mixtral: Mistral's layers with a mixture of experts for every MLP (a softmax router picks two of
eight experts per token, their weights renormalised). Checkpoints call the block
``block_sparse_moe`` and each expert's projections w1 (gate), w3 (up), w2 (down)."""
from __future__ import annotations

from typing import Any

from torch import nn

from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig, ConfigReading, ExpertsConfig, positive_int
from octavo.model.layers.moe import SparseMoEBlock
from octavo.model.models.mistral import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        experts = ExpertsConfig(num_experts=positive_int(raw, "num_local_experts"),
                                top_k=positive_int(raw, "num_experts_per_tok"),
                                intermediate_size=positive_int(raw, "intermediate_size"), renormalize=True)
        return ConfigReading(sliding_window=raw.get("sliding_window") is not None, experts=experts)

    def make_mlp(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        return SparseMoEBlock(arch, backends, f"model.layers.{layer_idx}.mlp", ("w1", "w3", "w2"))
