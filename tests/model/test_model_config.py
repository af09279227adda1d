"""config.json / generation_config.json parsing, and rotary frequencies vs transformers."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from octavo.model.config import parse_arch_config
from octavo.model.generation_config import load_generation_defaults
from octavo.model.layers.rotary import inverse_frequencies, rotary_dim

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


def test_yarn_stretches_the_context_limit():
    """Qwen2.5's documented 128k set-up: its 32k config plus yarn factor 4 over the 32k it was trained on."""
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    arch = parse_arch_config({**qwen, "rope_scaling": yarn})
    assert arch.context_limit == 131072 and arch.max_model_len() == 131072
    assert arch.max_model_len(10**7) == 131072 and arch.max_model_len(8192) == 8192
    assert parse_arch_config(qwen).max_model_len(131072) == 32768  # no scaling: the config's own limit
    # A config whose max_position_embeddings already names the stretched length (DeepSeek-V3) keeps it.
    longer = parse_arch_config({**qwen, "max_position_embeddings": 163840,
                                "rope_scaling": {**yarn, "original_max_position_embeddings": 4096}})
    assert longer.context_limit == 163840


def test_each_family_reads_its_windows_and_biases():
    qwen2 = parse_arch_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3,
                               "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1})
    assert qwen2.layer_windows == (None, 64, 64)
    # Qwen2 checkpoints routinely carry a sliding_window they do not use.
    off = parse_arch_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64})
    assert off.layer_windows == (None, None)
    mistral = parse_arch_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert mistral.layer_windows == (32, 32)
    typed = parse_arch_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
                               "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})
    assert typed.layer_windows == (8, None)
    llama = parse_arch_config({**BASE, "attention_bias": True, "mlp_bias": True, "sliding_window": 8})
    assert llama.attention_bias and llama.mlp_bias
    assert llama.layer_windows == (None, None)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "LlamaForCausalLM"),
        ({"architectures": []}, "architectures"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "magic", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "short_factor"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
          "original_max_position_embeddings": None, "max_position_embeddings": None}, "original_max_position_embeddings"),
        ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
        ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"rope_scaling": {"type": "linear"}}, "factor"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, "mlp_only_layers": "0"},
         "mlp_only_layers"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 8, "decoder_sparse_step": "x"}, "decoder_sparse_step"),
        ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2, "num_experts_per_tok": 3},
         "num_experts_per_tok"),
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


def test_gemma2_alternates_windows_without_layer_types():
    """Gemma 2 checkpoints on the Hub carry no layer_types: even layers slide."""
    arch = parse_arch_config({**BASE, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4,
                              "head_dim": 32, "sliding_window": 16, "query_pre_attn_scalar": 144,
                              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                              "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"})
    assert arch.layer_windows == (16, None, 16, None)
    assert arch.head_dim == 32 and arch.attention_scale == pytest.approx(144**-0.5)
    assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.local_rope is None


def test_gemma3_ropes_in_both_layouts():
    """The older config.json (rope_local_base_freq, rope_scaling for global
    layers, sliding_window_pattern) and transformers v5's per-layer-type
    rope_parameters give the same layers and ropes."""
    common = {**BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6, "sliding_window": 512}
    old = parse_arch_config({**common, "sliding_window_pattern": 3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                             "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    v5 = parse_arch_config({**common, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
                            "rope_parameters": {
                                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    for arch in (old, v5):
        assert arch.layer_windows == (512, 512, None, 512, 512, None)
        assert (arch.rope.rope_type, arch.rope.theta, arch.rope.factor) == ("linear", 1e6, 8.0)
        assert (arch.local_rope.rope_type, arch.local_rope.theta) == ("default", 1e4)
        assert arch.layer_rope(0) is arch.local_rope and arch.layer_rope(2) is arch.rope
    # Neither theta written: transformers' defaults (1e6 global, 1e4 local).
    bare = parse_arch_config(common)
    assert (bare.rope.theta, bare.local_rope.theta) == (1e6, 1e4)
    assert bare.layer_windows == (512,) * 5 + (None,)  # pattern 6 by default


PHI_LONGROPE = {"short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0, 12.0, 20.0]}


@pytest.mark.parametrize("max_len", [1024, 4096])
@pytest.mark.parametrize("layout", ["v5", "su"])
def test_longrope_partial_rotary_frequencies_match_transformers(layout, max_len):
    """Phi-4-mini's shape (partial rotary over 12 of 16 dims, LongRoPE):
    short factors for an engine within the trained 1024 positions, long
    beyond, the attention factor from the two lengths, as transformers."""
    raw = {**BASE, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 1024,
           "partial_rotary_factor": 0.75, "rope_theta": 10000.0}
    if layout == "v5":
        raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, **PHI_LONGROPE}
    else:  # the Phi-3 / Phi-3.5 files on the Hub
        raw["rope_scaling"] = {"type": "su", **PHI_LONGROPE}
    arch = parse_arch_config(raw)
    config = transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=4096, original_max_position_embeddings=1024,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         **PHI_LONGROPE},
    )
    seq_len = max_len if max_len > 1024 else None
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    rotated = rotary_dim(arch.rope, arch.head_dim)
    assert rotated == 12
    freq, factor = inverse_frequencies(arch.rope, rotated, max_len)
    torch.testing.assert_close(freq, ref_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor) and factor > 1.0
    short = parse_arch_config({**raw, "max_position_embeddings": 1024})
    assert inverse_frequencies(short.rope, rotated, 1024)[1] == 1.0  # no extension: no attention factor


def test_longrope_factor_lists_must_fit_the_rotated_dims():
    raw = {**BASE, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 1024,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}}
    arch = parse_arch_config(raw)
    with pytest.raises(ValueError, match="short_factor has 3 entries"):
        inverse_frequencies(arch.rope, rotary_dim(arch.rope, arch.head_dim), 512)
