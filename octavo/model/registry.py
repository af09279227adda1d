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


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ArchSwitches]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
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
