"""The architecture registry, keyed by config.json's ``architectures[0]``.

All supported architectures share one decoder (``models/decoder.py``); each
only decides a handful of switches from its config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ArchSwitches:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary
    sliding_window_enabled: bool = False
    # Every sliding_pattern-th layer is global, the others slide, where
    # config.json has no layer_types (Gemma 2: 2; Gemma 3: 6); 0: no pattern.
    sliding_pattern: int = 0
    # Gemma: RMSNorm scales by (1 + weight), in float32 before the cast back;
    # embeddings times sqrt(hidden_size) (rounded to the model dtype);
    # norms after attention and around the MLP too ("sandwich");
    # the softmax scale from query_pre_attn_scalar.
    gemma_norm: bool = False
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: bool = False
    # Gemma 3: sliding layers have a rotary embedding of their own.
    local_rope: bool = False
    # Phi-3: partial_rotary_factor may rotate a leading part of each head only.
    partial_rotary: bool = False
    # Phi-3 checkpoints store qkv_proj and gate_up_proj fused (split on load).
    fused_checkpoint: bool = False


def _llama(raw: dict[str, Any]) -> ArchSwitches:
    bias = bool(raw.get("attention_bias", False))
    return ArchSwitches(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


def _mistral(raw: dict[str, Any]) -> ArchSwitches:
    return ArchSwitches(sliding_window_enabled=raw.get("sliding_window") is not None)


def _qwen2(raw: dict[str, Any]) -> ArchSwitches:
    return ArchSwitches(qkv_bias=True, sliding_window_enabled=bool(raw.get("use_sliding_window", False)))


def _qwen3(raw: dict[str, Any]) -> ArchSwitches:
    bias = bool(raw.get("attention_bias", False))
    return ArchSwitches(
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        sliding_window_enabled=bool(raw.get("use_sliding_window", False)),
    )


def _gemma(sliding_pattern: int, **extra: bool) -> ArchSwitches:
    return ArchSwitches(sliding_window_enabled=True, sliding_pattern=sliding_pattern, gemma_norm=True,
                        scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=True, **extra)


def _gemma2(raw: dict[str, Any]) -> ArchSwitches:
    return _gemma(2, qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)))


def _gemma3(raw: dict[str, Any]) -> ArchSwitches:
    bias = bool(raw.get("attention_bias", False))
    return _gemma(int(raw.get("sliding_window_pattern") or 6), qkv_bias=bias, o_bias=bias, qk_norm=True,
                  local_rope=True)


def _phi3(raw: dict[str, Any]) -> ArchSwitches:
    return ArchSwitches(sliding_window_enabled=raw.get("sliding_window") is not None, partial_rotary=True,
                        fused_checkpoint=True)


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ArchSwitches]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
    # The same decoders saved without their LM head (transformers' AutoModel,
    # embedding checkpoints): their tensors lack the "model." prefix.
    "LlamaModel": _llama,
    "MistralModel": _mistral,
    "Qwen2Model": _qwen2,
    "Qwen3Model": _qwen3,
}
HEADLESS_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})


def switches_for(architecture: str, raw: dict[str, Any]) -> ArchSwitches:
    parse = ARCHITECTURES.get(architecture)
    if parse is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return parse(raw)
