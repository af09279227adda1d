"""The model registry: config.json's ``architectures[0]`` -> the model class that builds it.

A model family is one file in ``octavo/model/models/`` and one line in ``_FAMILIES``. Classes are
imported when first asked for, so reading a config imports only its own family; ``register_model``
adds a class from outside the package (a plugin, a test's toy family)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from octavo.model.models.causal_lm import CausalLM

# architecture -> (module in octavo.model.models, class name)
_FAMILIES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    # The same decoders saved without their LM head (transformers' AutoModel,
    # embedding checkpoints): their tensors lack the "model." prefix.
    "LlamaModel": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("mistral", "MistralForCausalLM"),
    "Qwen2Model": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3Model": ("qwen3", "Qwen3ForCausalLM"),
}
HEADLESS_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
_REGISTERED: dict[str, type[CausalLM]] = {}


def register_model(architecture: str, model_class: type[CausalLM]) -> None:
    """Serve checkpoints whose config.json names ``architecture`` with ``model_class``."""
    _REGISTERED[architecture] = model_class


def supported_architectures() -> list[str]:
    return sorted({*_FAMILIES, *_REGISTERED})


def model_class_for(architecture: str) -> type[CausalLM]:
    """The class for ``architecture``; ValueError naming the supported ones when there is none."""
    if architecture in _REGISTERED:
        return _REGISTERED[architecture]
    if architecture not in _FAMILIES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}")
    module, name = _FAMILIES[architecture]
    return getattr(importlib.import_module(f"octavo.model.models.{module}"), name)
