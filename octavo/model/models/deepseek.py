"""DeepSeek-V2 and DeepSeek-V3: pre-norm layers of multi-head latent attention
(``model/layers/latent_attention.py``) and mixtures of many small experts plus ungated shared ones.

The first ``first_k_dense_replace`` layers (and those off every ``moe_layer_freq``-th) keep a dense
MLP. V2 routes by softmax scores, over every expert (``topk_method`` greedy) or within the best
``topk_group`` of ``n_group`` expert groups, each group scored by its best expert
(group_limited_greedy). V3 routes by sigmoid scores plus a per-expert correction bias that decides
the choice only (noaux_tc), each group scored by its best two experts, the chosen weights
renormalised where norm_topk_prob says. Both scale the weights by routed_scaling_factor. Checkpoints
name the shared experts ``shared_experts`` (one MLP of n_shared_experts x moe_intermediate_size).
V2 rotates the rotary dims in interleaved pairs; V3 where ``rope_interleave`` says (the default)."""
from __future__ import annotations

from typing import Any

from torch import nn

from octavo.model.backends import ModelBackends
from octavo.model.config import (ArchConfig, ConfigReading, ExpertRouting, ExpertsConfig, LatentAttentionConfig,
                                 positive_int, positive_or_none)
from octavo.model.layers.latent_attention import LatentAttention
from octavo.model.layers.moe import SparseMoEBlock
from octavo.model.models.llama import LlamaForCausalLM, PreNormDecoderLayer


def _non_negative_int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.json: {key} must be a non-negative integer, got {value!r}")
    return value


def _expect(raw: dict[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = raw.get(key) or default
    if value not in allowed:
        raise ValueError(f"config.json: {key} must be {' or '.join(allowed)} for {raw['architectures'][0]}, "
                         f"got {value!r}")
    return value


def latent_attention_config(raw: dict[str, Any], rope_interleave: bool) -> LatentAttentionConfig:
    rope = positive_int(raw, "qk_rope_head_dim")
    if rope % 2:
        raise ValueError(f"config.json: qk_rope_head_dim must be even (rotary dims pair up), got {rope}")
    return LatentAttentionConfig(
        kv_lora_rank=positive_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=positive_int(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=rope,
        v_head_dim=positive_int(raw, "v_head_dim"),
        q_lora_rank=None if raw.get("q_lora_rank") is None else positive_int(raw, "q_lora_rank"),
        rope_interleave=rope_interleave,
    )


def deepseek_experts(raw: dict[str, Any], routing: ExpertRouting, renormalize: bool) -> ExpertsConfig:
    layers = positive_int(raw, "num_hidden_layers")
    first_dense = _non_negative_int(raw, "first_k_dense_replace", 0)
    freq = positive_int(raw, "moe_layer_freq") if raw.get("moe_layer_freq") is not None else 1
    intermediate = positive_int(raw, "moe_intermediate_size")
    return ExpertsConfig(
        num_experts=positive_int(raw, "n_routed_experts"),
        top_k=positive_int(raw, "num_experts_per_tok"),
        intermediate_size=intermediate,
        renormalize=renormalize,
        shared_intermediate_size=intermediate * _non_negative_int(raw, "n_shared_experts", 0),
        dense_layers=frozenset(i for i in range(layers) if i < first_dense or i % freq),
        routing=routing,
        shared_expert_gate=False,
    )


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    checkpoint_renames = {".mlp.shared_experts.": ".mlp.shared_expert."}
    rope_interleave_key = None  # V2 always pairs its rotary dims

    @classmethod
    def routing(cls, raw: dict[str, Any]) -> tuple[ExpertRouting, bool]:
        """(how the router chooses, whether the chosen weights are renormalised)."""
        _expect(raw, "scoring_func", ("softmax",), "softmax")
        method = _expect(raw, "topk_method", ("greedy", "group_limited_greedy"), "greedy")
        scale = positive_or_none(raw, "routed_scaling_factor") or 1.0
        # transformers' DeepSeek-V2 never renormalises (the published configs say norm_topk_prob false).
        if method == "greedy":
            return ExpertRouting(scale=scale), False
        groups = positive_int(raw, "n_group")
        return ExpertRouting(groups=groups, top_groups=positive_int(raw, "topk_group"), scale=scale), False

    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        routing, renormalize = cls.routing(raw)
        interleave = True if cls.rope_interleave_key is None else bool(raw.get(cls.rope_interleave_key, True))
        mla = latent_attention_config(raw, interleave)
        return ConfigReading(experts=deepseek_experts(raw, routing, renormalize), latent_attention=mla,
                             head_dim=mla.qk_rope_head_dim)

    def make_mlp(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        if layer_idx in arch.experts.dense_layers:
            return super().make_mlp(arch, layer_idx, backends)
        return SparseMoEBlock(arch, backends, f"model.layers.{layer_idx}.mlp", ("gate_proj", "up_proj", "down_proj"))

    def make_layer(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        attention = LatentAttention(arch, layer_idx, backends, f"model.layers.{layer_idx}.self_attn")
        return PreNormDecoderLayer(arch, backends, attention, self.make_mlp(arch, layer_idx, backends))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    rope_interleave_key = "rope_interleave"

    @classmethod
    def routing(cls, raw: dict[str, Any]) -> tuple[ExpertRouting, bool]:
        _expect(raw, "scoring_func", ("sigmoid",), "sigmoid")
        _expect(raw, "topk_method", ("noaux_tc",), "noaux_tc")
        groups = positive_int(raw, "n_group") if raw.get("n_group") is not None else 1
        top_groups = positive_int(raw, "topk_group") if raw.get("topk_group") is not None else groups
        experts = positive_int(raw, "n_routed_experts")
        if experts // groups < 2:
            raise ValueError(f"config.json: n_group ({groups}) must leave at least two of the {experts} experts "
                             "in each group (a group scores by its best two)")
        routing = ExpertRouting(scoring="sigmoid", groups=groups, top_groups=top_groups, group_score="top2",
                                score_bias=True, scale=positive_or_none(raw, "routed_scaling_factor") or 2.5)
        # Defaults as transformers' DeepseekV3Config has them, for files that leave them out.
        return routing, bool(raw.get("norm_topk_prob", True))
