"""Qwen3-MoE: Qwen3's layers (q/k norms) whose MLPs are mixtures of experts as Qwen2-MoE reads them,
without a shared expert."""
from __future__ import annotations

from octavo.model.models.qwen2_moe import QwenSparseLayers
from octavo.model.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(QwenSparseLayers, Qwen3ForCausalLM):
    has_shared_expert = False
