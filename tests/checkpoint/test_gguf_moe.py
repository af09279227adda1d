"""GGUF mixtures of experts written from tiny transformers models as llama.cpp's converter writes
them (Mixtral as "llama", Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE): the
config read from the metadata is config.json's; float files give transformers' logits on the stored
weights; Q8_0/Q4_0/Q4_1 experts run quantized on the int kernels (the routers in float) within the
dense files' tolerance of transformers on the dequantized weights, with identical greedy tokens;
experts of a type no kernel runs are dequantized; a stacked expert tensor that is missing or of the
wrong shape is one ``octavo: error:`` line naming it. Float activations throughout
(``quantized_activations="float"``): the reference is transformers on the dequantized weights."""
from __future__ import annotations

import logging

import gguf
import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.entrypoints.cli import main
from octavo.model.config import load_arch_config
from tests.checkpoint.conftest import FLOAT_ATOL, PROMPT, QUANT_ATOL, octavo_logits
from tests.checkpoint.gguf_writer import rewrite_gguf
from tests.engine.conftest import hf_greedy
from tests.model_factory import load_hf_model
from tests.worker.runner_utils import hf_logits, make_runner

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]


def _kernels(path) -> dict[str, str]:
    """Module name -> its kernel, for the linear layers and the experts."""
    model = make_runner(path).model
    return {name: m.weight_method.kernel_name(m) for name, m in model.named_modules() if hasattr(m, "weight_method")}


@pytest.mark.parametrize("arch", MOE)
def test_config_comes_from_the_metadata(files, arch):
    path, reference = files(arch, "F32")
    ours, hf = load_arch_config(path), load_arch_config(reference)
    assert (ours.architecture, ours.experts, ours.intermediate_size) == (hf.architecture, hf.experts,
                                                                           hf.intermediate_size)


@pytest.mark.parametrize("arch, matrix_type", [("mixtral", "F32"), ("qwen2_moe", "F16"), ("qwen3_moe", "BF16")])
def test_float_files_match_transformers(files, arch, matrix_type):
    path, reference = files(arch, matrix_type)
    got, tokens = octavo_logits(path, quantized_activations="float")
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=FLOAT_ATOL, rtol=0)


@pytest.mark.parametrize("arch, matrix_type", [
    ("mixtral", "Q8_0"), ("mixtral", "Q4_0"), ("qwen2_moe", "Q8_0"), ("qwen2_moe", "Q4_1"), ("qwen3_moe", "Q4_0"),
    ("qwen3_moe", "Q4_1"),
])
def test_experts_run_on_the_int_kernels(files, arch, matrix_type):
    path, reference = files(arch, matrix_type)
    kernels = _kernels(path)
    bits = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}[matrix_type]
    experts = {name: k for name, k in kernels.items() if name.endswith(".experts")}
    assert experts and all(k.startswith(f"gguf {matrix_type} (int{bits} group 32): int{bits}") and
                           k.endswith("(experts)") for k in experts.values()), experts
    # The routers stay float, whatever their type in the file (Qwen2-MoE's shared expert gate is quantized there).
    routers = {name: k for name, k in kernels.items() if name.endswith((".mlp.gate", ".shared_expert_gate"))}
    assert routers and set(routers.values()) == {"torch"}, routers
    got, tokens = octavo_logits(path, quantized_activations="float")
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=QUANT_ATOL, rtol=0)


@pytest.mark.parametrize("arch, matrix_type", [("mixtral", "Q4_1"), ("qwen2_moe", "Q4_0"), ("qwen3_moe", "Q8_0")])
def test_greedy_tokens_match_transformers(files, arch, matrix_type):
    path, reference = files(arch, matrix_type)
    prompts = [PROMPT[:n] for n in (1, 9, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = LLM(path, dtype="float32", quantized_activations="float").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(reference, prompts, new_tokens=16)


def test_gate_up_and_down_of_two_kernel_types_both_stay_quantized(files):
    """Q4_0 gate/up beside Q8_0 down (a layer's experts may mix types that have kernels)."""
    down = {f"model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": "Q8_0" for i in range(2) for e in range(4)}
    path, reference = files("mixtral", "Q4_0", types=down)
    (kernel,) = {k for name, k in _kernels(path).items() if name.endswith(".experts")}
    assert kernel.startswith("gguf Q4_0 (int4 group 32), down gguf Q8_0 (int8 group 32): int4"), kernel
    got, tokens = octavo_logits(path, quantized_activations="float")
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=QUANT_ATOL, rtol=0)


def test_experts_of_a_type_without_kernel_are_dequantized(files, caplog):
    """Q5_0 down projections (no kernel): that layer's experts all run in float, gate and up too."""
    down = {f"model.layers.{i}.mlp.experts.{e}.down_proj.weight": "Q5_0" for i in range(2) for e in range(8)}
    path, reference = files("qwen3_moe", "Q8_0", types=down)
    with caplog.at_level(logging.INFO, logger="octavo.model.gguf.tensors"):
        kernels = _kernels(path)
    assert {k for name, k in kernels.items() if name.endswith(".experts")} == {"torch (experts)"}
    assert kernels["model.layers.0.self_attn.qkv_proj"].startswith("gguf Q8_0")
    # Q8_0: both layers' stacked gate and up, beside the embedding and the output layer (always float).
    assert "2 tensors of Q5_0, 6 tensors of Q8_0" in caplog.text
    got, tokens = octavo_logits(path, quantized_activations="float")
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=QUANT_ATOL, rtol=0)


def _stacked(path, name: str):
    return next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


@pytest.mark.parametrize("arch, change, words", [
    ("qwen3_moe", "missing", "has no blk.1.ffn_up_exps.weight tensor"),
    ("mixtral", "one expert short", "tensor blk.1.ffn_down_exps.weight has shape [128, 64, 3]; expected [128, 64, 4]"),
    ("qwen2_moe", "narrower", "tensor blk.0.ffn_gate_exps.weight has shape [64, 16, 4]; expected [64, 32, 4]"),
])
def test_a_broken_expert_tensor_is_one_error_line_naming_it(files, tmp_path, capsys, arch, change, words):
    path, _ = files(arch, "F32")
    if change == "missing":
        tensors = {"blk.1.ffn_up_exps.weight": None}
    elif change == "one expert short":
        tensors = {"blk.1.ffn_down_exps.weight": _stacked(path, "blk.1.ffn_down_exps.weight").data[:3]}
    else:
        tensors = {"blk.0.ffn_gate_exps.weight": _stacked(path, "blk.0.ffn_gate_exps.weight").data[:, :16]}
    broken = rewrite_gguf(path, tmp_path / "broken.gguf", tensors=tensors)
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(broken), "--prompt", "hi"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert exc.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("octavo: error: ") and "broken.gguf" in errors[0] and words in errors[0]
