"""GGUF ``deepseek2`` files written from tiny transformers DeepSeek models as llama.cpp's converter writes them
(tests/checkpoint/gguf_writer.py): DeepSeek-V2-Lite's shape (no query LoRA, greedy softmax routing), V2 (a query
LoRA, routing within groups) and V3 (sigmoid scores, the correction bias, groups, YaRN), each with kv_b_proj split
into attn_k_b / attn_v_b as newer converters write it and whole as older ones did. The config read from the metadata
is config.json's; float files (F32, BF16, F16) give transformers' logits on the same weights (float32, within 1e-4)
and its greedy tokens; Q8_0 layers run on the int kernels with kv_b_proj in float; a missing tensor is one ``octavo:
error:`` line naming it; metadata out of bounds, or at odds with the tensors, is a ValueError naming the key and the
value."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.entrypoints.cli import main
from octavo.model.config import load_arch_config
from tests.checkpoint.conftest import FLOAT_ATOL, PROMPT, QUANT_ATOL, octavo_logits
from tests.checkpoint.gguf_writer import rewrite_gguf
from tests.engine.conftest import hf_greedy
from tests.model_factory import VARIANTS, load_hf_model
from tests.worker.runner_utils import hf_logits, make_runner

# tests/model_factory.py's DeepSeek variants, with scoring_func as the published configs have it (the converter
# writes expert_gating_func from it). V3's YaRN with mscale equal to mscale_all_dim, as in every released DeepSeek
# config: the converter keeps mscale_all_dim only (octavo/model/gguf/deepseek2.py).
_V3_YARN = {**VARIANTS["deepseek_v3"][1]["rope_parameters"], "mscale": 0.7, "mscale_all_dim": 0.7}
DEEPSEEK = {"v2-lite": ("deepseek_v2", {**VARIANTS["deepseek_v2_lite"][1], "scoring_func": "softmax"}),
            "v2": ("deepseek_v2", {**VARIANTS["deepseek_v2"][1], "scoring_func": "softmax"}),
            "v3": ("deepseek_v3", {**VARIANTS["deepseek_v3"][1], "rope_parameters": _V3_YARN,
                                   "scoring_func": "sigmoid"})}
LAYOUTS = {"split-kv-b": True, "whole-kv-b": False}


def deepseek_file(files, name: str, matrix_type: str = "F32", split_kv_b: bool = True, types=None):
    arch, overrides = DEEPSEEK[name]
    return files(arch, matrix_type, types=types, split_kv_b=split_kv_b, **overrides)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", DEEPSEEK)
def test_config_comes_from_the_metadata(files, name, layout):
    path, reference = deepseek_file(files, name, split_kv_b=LAYOUTS[layout])
    ours, hf = load_arch_config(path), load_arch_config(reference)
    # GGUF stores floats in 32 bits (rms_norm_eps, V3's 0.1 x mscale_all_dim).
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert (ours.rope.mscale, ours.rope.mscale_all_dim) == pytest.approx((hf.rope.mscale, hf.rope.mscale_all_dim))
    rope = replace(ours.rope, mscale=hf.rope.mscale, mscale_all_dim=hf.rope.mscale_all_dim)
    assert replace(ours, rms_norm_eps=hf.rms_norm_eps, rope=rope, eos_token_ids=hf.eos_token_ids[:1]) == hf


def test_a_file_without_gating_function_is_deepseek_v2(files, tmp_path):
    """Files converted before llama.cpp wrote expert_gating_func: softmax scores, DeepSeek-V2."""
    path, reference = deepseek_file(files, "v2", split_kv_b=False)
    older = rewrite_gguf(path, tmp_path / "older.gguf", drop=("deepseek2.expert_gating_func",))
    assert load_arch_config(older) == load_arch_config(path)


@pytest.mark.parametrize("name, layout, matrix_type", [
    *((name, layout, "F32") for name in DEEPSEEK for layout in LAYOUTS),
    ("v3", "split-kv-b", "BF16"), ("v2", "whole-kv-b", "F16"),
])
def test_float_files_match_transformers(files, name, layout, matrix_type):
    path, reference = deepseek_file(files, name, matrix_type, LAYOUTS[layout])
    got, tokens = octavo_logits(path)
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=FLOAT_ATOL, rtol=0)


@pytest.mark.parametrize("name", DEEPSEEK)
def test_greedy_tokens_match_transformers(files, name):
    path, reference = deepseek_file(files, name)
    prompts = [PROMPT[:n] for n in (1, 9, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(reference, prompts, new_tokens=16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_q8_0_layers_run_on_the_int_kernels_and_kv_b_in_float(files, layout):
    """Every linear layer quantized in the file runs on the int8 kernel but kv_b_proj (decode multiplies by its
    halves directly), which is dequantized where the file quantized it (whole; split halves of 16 dims per
    head are too narrow for 32-wide blocks and stay F32, as the converter would keep them)."""
    split = LAYOUTS[layout]
    types = {f"model.layers.{i}.self_attn.kv_b_proj.weight": "F32" for i in range(2)} if split else None
    path, reference = deepseek_file(files, "v2-lite", "Q8_0", split, types)
    model = make_runner(path).model
    kernels = {name: m.linear_method.kernel_name(m) for name, m in model.named_modules()
               if hasattr(m, "linear_method")}
    assert {k for name, k in kernels.items() if name.endswith("kv_b_proj")} == {"torch"}
    attention = [k for name, k in kernels.items() if name.endswith(("q_proj", "kv_a_proj_with_mqa", "o_proj"))]
    assert len(attention) == 6 and all(k.startswith("gguf Q8_0 (int8 group 32)") for k in attention), kernels
    got, tokens = octavo_logits(path, quantized_activations="float")
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=QUANT_ATOL, rtol=0)


@pytest.mark.parametrize("name, layout, tensor", [
    ("v3", "split-kv-b", "blk.1.attn_v_b.weight"),
    ("v3", "split-kv-b", "blk.1.exp_probs_b.bias"),
    ("v2", "whole-kv-b", "blk.0.attn_q_a_norm.weight"),
    ("v2-lite", "whole-kv-b", "blk.1.ffn_down_shexp.weight"),
    ("v2-lite", "split-kv-b", "blk.1.ffn_up_exps.weight"),
])
def test_a_missing_tensor_is_one_error_line_naming_it(files, tmp_path, capsys, name, layout, tensor):
    path, _ = deepseek_file(files, name, split_kv_b=LAYOUTS[layout])
    broken = rewrite_gguf(path, tmp_path / "broken.gguf", tensors={tensor: None})
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(broken), "--prompt", "hi"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert exc.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("octavo: error: ") and f"broken.gguf has no {tensor} tensor" in errors[0], errors


@pytest.mark.parametrize("key, value, words", [
    ("attention.kv_lora_rank", 1 << 40, "must be an integer from 1 to 1048576"),
    ("attention.q_lora_rank", -1, "must be an integer from 0 to 1048576"),
    ("expert_count", 10**9, "must be an integer from 1 to 65536"),
    ("expert_used_count", 9, "must be an integer from 1 to 8"),
    ("leading_dense_block_count", 3, "must be an integer from 0 to 2"),
    ("expert_gating_func", 7, "must be an integer from 1 to 2"),
    ("rope.dimension_count", 40, "must be even and below the key length 24"),
    ("rope.scaling.yarn_log_multiplier", float("nan"), "must be a finite positive number"),
    # Within bounds, but not the tensors' sizes: the first tensor it shapes is named.
    ("attention.kv_lora_rank", 48, "tensor blk.0.attn_kv_a_mqa.weight has shape [64, 40]; expected [64, 56]"),
    ("expert_feed_forward_length", 1 << 16, "tensor blk.1.ffn_gate_shexp.weight has shape [64, 32]; expected "
                                            "[64, 65536]"),
])
def test_metadata_out_of_bounds_or_at_odds_with_the_tensors_is_named(files, tmp_path, key, value, words):
    path, _ = deepseek_file(files, "v3")
    hostile = rewrite_gguf(path, tmp_path / "hostile.gguf", **{f"deepseek2.{key}": value})
    with pytest.raises(ValueError) as raised:
        load_arch_config(hostile)
    message = str(raised.value)
    assert str(hostile) in message and "\n" not in message and words in message, message
    if "tensor" not in words:
        assert f"'deepseek2.{key}'" in message and repr(value) in message, message
