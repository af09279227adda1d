"""config.json / generation_config.json parsing, and rotary frequencies vs transformers."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from octavo.model.config import parse_arch_config
from octavo.model.generation_config import load_generation_defaults
from octavo.model.layers.rotary import inverse_frequencies

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
}

# The same scaling written the v5 way and the older way.
ROPE_CASES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 4.0}),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, {"type": "dynamic", "factor": 2.0}),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ),
    "yarn_mscale": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "mscale": 1.0,
         "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "mscale": 1.0,
         "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    ),
    "yarn_attention_factor": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.3},
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.3},
    ),
}


def _hf_reference(params: dict) -> tuple[torch.Tensor, float]:
    config = transformers.LlamaConfig(
        **{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
        rope_parameters={"rope_theta": 50000.0, **params},
    )
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_match_transformers_in_both_layouts(case):
    v5, old = ROPE_CASES[case]
    ref_freq, ref_factor = _hf_reference(v5)
    for raw in (
        {**BASE, "rope_parameters": {"rope_theta": 50000.0, **v5}},
        {**BASE, "rope_theta": 50000.0, "rope_scaling": old},
    ):
        arch = parse_arch_config(raw)
        freq, factor = inverse_frequencies(arch.rope, arch.head_dim, arch.max_position_embeddings)
        torch.testing.assert_close(freq, ref_freq, rtol=1e-6, atol=0)
        assert factor == pytest.approx(ref_factor)
    if case.startswith("yarn"):
        assert factor != 1.0  # the attention factor really is exercised


def test_default_rope_and_shape_fields():
    arch = parse_arch_config({**BASE, "rope_theta": 1234.0, "head_dim": 32, "tie_word_embeddings": True,
                              "eos_token_id": [2, 7], "torch_dtype": "bfloat16"})
    assert (arch.rope.rope_type, arch.rope.theta) == ("default", 1234.0)
    assert arch.head_dim == 32 and arch.num_kv_heads == 2 and arch.tie_word_embeddings
    assert arch.eos_token_ids == (2, 7) and arch.dtype == "bfloat16"
    assert parse_arch_config({**BASE, "dtype": "float16", "eos_token_id": 3}).eos_token_ids == (3,)
    assert parse_arch_config(BASE).head_dim == 16  # hidden / heads
    assert parse_arch_config(BASE).max_model_len(100) == 100
    assert parse_arch_config(BASE).max_model_len(10**6) == 4096


def test_architecture_switches_and_windows():
    qwen2 = parse_arch_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3,
                               "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1})
    assert qwen2.switches.qkv_bias and not qwen2.switches.o_bias
    assert qwen2.layer_windows == (None, 64, 64)
    # Qwen2 checkpoints routinely carry a sliding_window they do not use.
    off = parse_arch_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64})
    assert off.layer_windows == (None, None)
    mistral = parse_arch_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert mistral.layer_windows == (32, 32)
    typed = parse_arch_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
                               "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})
    assert typed.layer_windows == (8, None) and typed.switches.qk_norm
    llama = parse_arch_config({**BASE, "attention_bias": True, "mlp_bias": True, "sliding_window": 8})
    assert llama.switches.qkv_bias and llama.switches.o_bias and llama.switches.mlp_bias
    assert llama.layer_windows == (None, None)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "LlamaForCausalLM"),
        ({"architectures": []}, "architectures"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"type": "linear"}}, "factor"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"layer_types": ["full_attention"], "architectures": ["Qwen2ForCausalLM"],
          "use_sliding_window": True, "sliding_window": 4}, "layer_types"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        parse_arch_config({**BASE, **change})


def test_generation_defaults(tmp_path):
    assert load_generation_defaults(tmp_path).eos_token_ids == ()
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [128001, 128009], "temperature": 0.6, "top_p": 0.9, "top_k": 20})
    )
    gen = load_generation_defaults(tmp_path)
    assert gen.eos_token_ids == (128001, 128009)
    assert (gen.temperature, gen.top_p, gen.top_k, gen.min_p) == (0.6, 0.9, 20, None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_generation_defaults(tmp_path).eos_token_ids == (2,)
