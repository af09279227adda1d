"""Qwen2-MoE: Qwen2's layers whose MLPs are mixtures of experts (top-k of a softmax router, weights
renormalised where norm_topk_prob says) plus a shared expert every token goes through, scaled by a
sigmoid gate. Only every decoder_sparse_step-th layer is sparse, and mlp_only_layers keep a dense MLP.
Qwen3-MoE reads its experts the same way (``QwenSparseLayers``)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig, ConfigReading, ExpertsConfig, positive_int
from octavo.model.layers.moe import SparseMoEBlock
from octavo.model.models.qwen2 import Qwen2ForCausalLM


def qwen_experts(raw: dict[str, Any], shared: bool) -> ExpertsConfig:
    """The experts of a Qwen MoE config.json; ``shared``: it has a shared expert (Qwen2-MoE)."""
    layers = positive_int(raw, "num_hidden_layers")
    step = positive_int(raw, "decoder_sparse_step") if raw.get("decoder_sparse_step") is not None else 1
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got {only!r}")
    dense = {i for i in range(layers) if (i + 1) % step} | set(only)
    # transformers 5 writes num_local_experts where older files have num_experts.
    return ExpertsConfig(
        num_experts=positive_int(raw, "num_experts" if "num_experts" in raw else "num_local_experts"),
        top_k=positive_int(raw, "num_experts_per_tok"),
        intermediate_size=positive_int(raw, "moe_intermediate_size"),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=positive_int(raw, "shared_expert_intermediate_size") if shared else 0,
        dense_layers=frozenset(dense),
    )


class QwenSparseLayers:
    """Mixed into a Qwen family: its MLPs become expert blocks where config.json says they are sparse."""

    has_shared_expert = True

    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        return replace(super().config_reading(raw), experts=qwen_experts(raw, shared=cls.has_shared_expert))

    def make_mlp(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        if layer_idx in arch.experts.dense_layers:
            return super().make_mlp(arch, layer_idx, backends)
        return SparseMoEBlock(arch, backends, f"model.layers.{layer_idx}.mlp", ("gate_proj", "up_proj", "down_proj"))


class Qwen2MoeForCausalLM(QwenSparseLayers, Qwen2ForCausalLM):
    pass
