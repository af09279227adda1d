"""On-the-fly int8/int4 quantization (--quantization): the quantizers' error,
which layers stay unquantized, the options' refusals, and whole tiny models
of every architecture.

Two model checks: (1) exact, with float activations
(``quantized_activations="float"``): a quantized model's logits equal (1e-4,
float32) those of the unquantized model loaded from a checkpoint holding the
dequantized weights, so loading, fusing, packing and the kernels add nothing
to the quantization itself; (2) close, with the default int8 activations at
decode: the logits stay near the unquantized
model's, in bf16 (the serving dtype): relative RMS error <= 5% for int8 and
<= 35% for int4 in groups of 32. Random Gaussian weights are quantization's
worst case (measured: int8 1.6-2.5%, int4 20-26%); the trained model's
perplexity is the quality check (test_quantized_perplexity.py)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo.config import ModelConfig
from octavo.quant.onthefly import OnTheFlyScheme, quantize_int4, quantize_int8
from octavo.quant.quantized import QuantizedLinearMethod
from tests.worker.runner_utils import Blocks, make_request, make_runner, step

# phi4_mini: its checkpoint stores qkv_proj and gate_up_proj fused.
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "llama_tied", "gemma2", "phi4_mini"]
# Experts are quantized as linear weights are (their routers are not). Only the exact check runs on them: a
# random tiny router turns quantization's error into other experts wherever two scores are close. DeepSeek's
# kv_b_proj stays in float (its decode multiplies by the weight's halves directly).
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2_lite"]
GROUP = 32  # the tiny models' in-features are 64 and 128
# Both quantizers work row by row, so a fused tensor quantizes as its parts do.
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
         "w1", "w2", "w3", "kv_a_proj_with_mqa")


def test_int8_rounds_each_weight_to_the_nearest_step_of_its_row():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 40)[:, None]
    q = quantize_int8(w)
    _, scales, mins = q.unpack()
    assert mins is None and torch.allclose(scales[:, 0], w.abs().amax(1) / 127)
    assert ((q.dequantize() - w).abs() <= scales / 2 * (1 + 1e-5)).all()


def test_int4_maps_each_groups_range_onto_0_to_15():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    q = quantize_int4(w, 32)
    ints, scales, _ = q.unpack()
    groups = w.view(40, 3, 32)
    assert torch.allclose(scales, (groups.amax(2) - groups.amin(2)) / 15)
    assert ints.view(40, 3, 32).amin(2).eq(0).all() and ints.view(40, 3, 32).amax(2).eq(15).all()
    step = scales.repeat_interleave(32, 1)
    assert ((q.dequantize() - w).abs() <= step / 2 * (1 + 1e-4) + 1e-6).all()


def test_a_constant_group_is_exact():
    w = torch.full((16, 64), 0.25)
    assert torch.allclose(quantize_int4(w, 32).dequantize(), w)
    assert torch.allclose(quantize_int8(w).dequantize(), w)


def test_layers_matching_a_kept_pattern_stay_unquantized():
    scheme = OnTheFlyScheme("int8", 128, ("lm_head", "model.layers.0.*"))
    assert not isinstance(scheme.linear_method("lm_head"), QuantizedLinearMethod)
    assert not isinstance(scheme.linear_method("model.layers.0.mlp.down_proj"), QuantizedLinearMethod)
    assert isinstance(scheme.linear_method("model.layers.1.mlp.down_proj"), QuantizedLinearMethod)
    assert ModelConfig(model="m").unquantized_patterns == ()


@pytest.mark.parametrize("options, field", [({"quantization": "int3"}, "quantization"),
                                           ({"quantization": "int4", "quantization_group_size": 48},
                                            "quantization_group_size"),
                                           ({"quantized_activations": "int4"}, "quantized_activations")])
def test_bad_options_name_their_field(options, field):
    with pytest.raises(ValueError, match=f"^{field} must be one of"):
        ModelConfig(model="m", **options)


def test_a_group_size_that_does_not_divide_in_features_names_the_field(variant):
    with pytest.raises(ValueError, match="quantization_group_size 128 does not divide the in-features 64"):
        make_runner(variant("llama"), quantization="int4")  # hidden_size 64


def test_experts_whose_size_a_group_size_does_not_divide_name_the_field(variant):
    """Qwen3-MoE's experts have 32 intermediate features: the down products' in-features."""
    with pytest.raises(ValueError, match=r"quantization_group_size 64 does not divide the in-features 32 of "
                                         r"model\.layers\.0\.mlp\.experts \(down\)"):
        make_runner(variant("qwen3_moe"), quantization="int4", quantization_group_size=64)


def _prompt_logits(folder: Path, dtype: str = "float32", **options: object) -> torch.Tensor:
    """Logits of a 40-token prompt, as a 39-row chunk and a 1-row one (the
    many-row and the decode-sized paths)."""
    runner = make_runner(folder, dtype=dtype, **options)
    blocks = Blocks(runner)
    prompt = torch.randint(5, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    req = make_request("a", prompt)
    first = runner.execute_logits(step(blocks.chunk(req, 0, 39, sample=False)))["a"]
    last = runner.execute_logits(step(blocks.chunk(req, 39, 1)))["a"]
    return torch.cat([first, last])


def _dequantized_checkpoint(src: Path, dst: Path, quantize, head=None) -> Path:
    """``src`` with its projections' weights replaced by ``quantize``'s values; with ``head``, the
    lm_head's by ``head``'s, a tied one untied (the embedding keeps its float table)."""
    if dst.exists():
        return dst
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in _PROJ:
            tensors[name] = quantize(t).dequantize().to(t.dtype)
    if head is not None:
        config = json.loads((dst / "config.json").read_text())
        lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        tensors["lm_head.weight"] = head(lm_head).dequantize().to(lm_head.dtype)
        (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", ARCHS + MOE)
def test_quantized_model_equals_the_model_of_its_dequantized_weights(name, quantization, variant, tmp_path):
    quantize = quantize_int8 if quantization == "int8" else lambda t: quantize_int4(t, GROUP)
    # The lm_head is int8 by default under both.
    head = quantize_int8
    reference = _dequantized_checkpoint(variant(name), tmp_path / "dequantized", quantize, head)
    ours = _prompt_logits(variant(name), quantization=quantization, quantization_group_size=GROUP,
                          quantized_activations="float")
    diff = (ours - _prompt_logits(reference)).abs().max().item()
    assert diff < 1e-4, f"max abs diff {diff}"


@pytest.mark.parametrize("quantization, bound", [("int8", 0.05), ("int4", 0.35)])
@pytest.mark.parametrize("name", ARCHS)
def test_quantized_logits_stay_close_to_the_unquantized_models(name, quantization, bound, variant):
    ref = _prompt_logits(variant(name), "bfloat16")
    ours = _prompt_logits(variant(name), "bfloat16", quantization=quantization, quantization_group_size=GROUP)
    rms = ((ours - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rms <= bound, f"relative RMS logit error {rms:.3f} > {bound}"


def test_start_up_reports_the_bytes_before_and_after(variant, caplog):
    with caplog.at_level(logging.INFO, logger="octavo.model.loader"):
        runner = make_runner(variant("llama"), dtype="bfloat16", quantization="int8", lm_head_quantization="none")
    line = next(r.getMessage() for r in caplog.records if "as loaded" in r.getMessage())
    assert "int8 on the fly" in line and "lm_head: unquantized; kept unquantized: none" in line
    linears = [m for m in runner.model.modules() if hasattr(m, "linear_method")]
    quantized = [m for m in linears if isinstance(m.linear_method, QuantizedLinearMethod)]
    assert len(quantized) == len(linears) - 1 and runner.model.lm_head not in quantized
    # bf16 -> int8 + a float32 scale a row: a little under half.
    before = sum(m.weight.numel() * 2 for m in quantized)
    after = sum(m.prepared.nbytes for m in quantized)
    assert 0.5 < after / before < 0.55


@pytest.mark.parametrize("options, head", [({"quantization": "int4"}, "int8"), ({"quantization": "int8"}, "int8"),
                                           ({"quantization": "w8a8"}, None), ({}, None),
                                           ({"quantization": "int4", "lm_head_quantization": "none"}, None),
                                           ({"quantization": "int4", "unquantized_modules": "lm_*"}, None),
                                           ({"quantization": "int8", "lm_head_quantization": "int4"}, "int4")])
def test_the_lm_heads_format_follows_the_body_unless_named(options, head):
    assert ModelConfig(model="m", **options).lm_head_format == head


@pytest.mark.parametrize("options, message", [
    ({"quantization": "int4", "lm_head_quantization": "q6_k"}, "lm_head_quantization must be one of"),
    # A GGUF or pre-quantized checkpoint is loaded without --quantization: its head comes as stored.
    ({"lm_head_quantization": "int8"}, "lm_head_quantization 'int8' quantizes the LM head of a float checkpoint"),
    ({"quantization": "int4", "lm_head_quantization": "int8", "unquantized_modules": "model.layers.0.*,lm_head"},
     "lm_head_quantization 'int8' contradicts unquantized_modules pattern 'lm_head'"),
])
def test_a_head_format_that_cannot_apply_names_the_field(options, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        ModelConfig(model="m", **options)


def test_a_tied_int8_head_holds_int8_bytes_beside_the_float_embedding(variant):
    """The default under int4 (the logits: test_quantized_model_equals_the_model_of_its_dequantized_weights)."""
    runner = make_runner(variant("llama_tied"), dtype="float32", quantization="int4", quantization_group_size=GROUP)
    head, embedding = runner.model.lm_head, runner.model.model.embed_tokens
    vocab, hidden = embedding.weight.shape
    assert head.linear_method.kernel_name(head).startswith("int8")
    assert head.linear_method.weight_bytes(head) == vocab * hidden + 4 * vocab  # an int8 and a float32 scale a row
    stored = load_file(variant("llama_tied") / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(embedding.weight, stored.float())


def test_an_int4_head_is_quantized_in_the_bodys_groups(variant, tmp_path):
    quantize = lambda t: quantize_int4(t, GROUP)  # noqa: E731
    reference = _dequantized_checkpoint(variant("llama_tied"), tmp_path / "dequantized", quantize, head=quantize)
    ours = _prompt_logits(variant("llama_tied"), quantization="int4", quantization_group_size=GROUP,
                          lm_head_quantization="int4", quantized_activations="float")
    diff = (ours - _prompt_logits(reference)).abs().max().item()
    assert diff < 1e-4, f"max abs diff {diff}"
