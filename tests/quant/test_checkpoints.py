"""GPTQ, AWQ and compressed-tensors checkpoints of tiny Llama and Qwen2
models, written by the tests in each tool's layout, load as stored: with
float activations (``quantized_activations="float"``) Octavo's logits equal
transformers' on the dequantized weights (within 1e-3) and greedy tokens are
identical; in bf16, with the default int8 activations at decode, they stay
within bf16's bound; broken checkpoints are errors naming what is
wrong, raised before any tensor is read."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo import LLM, SamplingParams
from octavo.model.loader import load_model
from tests.engine.conftest import hf_greedy
from tests.model_factory import load_hf_model, make_tiny_model
from tests.quant.quantized_checkpoints import Quant, write_quantized
from tests.worker.runner_utils import Blocks, hf_logits, make_request, make_runner, step

CASES = {
    "gptq4-sym": ("llama", Quant("gptq", bits=4, sym=True)),
    "gptq4-asym": ("qwen2", Quant("gptq", bits=4, sym=False)),
    "gptq4-sym-actorder": ("qwen2", Quant("gptq", bits=4, sym=True, act_order=True)),
    "gptq4-asym-actorder": ("llama", Quant("gptq", bits=4, sym=False, act_order=True)),
    "gptq8-sym-channel": ("llama", Quant("gptq", bits=8, group_size=-1)),
    "gptq8-asym-actorder": ("qwen2", Quant("gptq", bits=8, sym=False, act_order=True)),
    "gptq4-v2": ("llama", Quant("gptq", bits=4, sym=False, checkpoint_format="gptq_v2")),
    "awq4": ("llama", Quant("awq", bits=4, sym=False)),
    "awq4-qwen2": ("qwen2", Quant("awq", bits=4, sym=False, group_size=16)),
    "ct-w4a16": ("llama", Quant("compressed-tensors", bits=4, sym=True)),
    "ct-w4a16-asym-actorder": ("qwen2", Quant("compressed-tensors", bits=4, sym=False, act_order=True)),
    "ct-w8a16-channel": ("qwen2", Quant("compressed-tensors", bits=8, group_size=-1)),
    "ct-w8a16-asym": ("llama", Quant("compressed-tensors", bits=8, sym=False)),
}
PROMPT = [random.Random(4).randrange(5, 512) for _ in range(40)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoints(case) -> (quantized folder, dequantized reference folder), written once."""
    root = tmp_path_factory.mktemp("quantized")
    made = {}

    def get(case):
        if case not in made:
            arch, quant = CASES[case]
            made[case] = write_quantized(make_tiny_model(root / "base", arch), root / case, quant)
        return made[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_on_dequantized_weights(case, checkpoints):
    folder, reference = checkpoints(case)
    runner = make_runner(folder, quantized_activations="float")
    kernels = {m.linear_method.kernel_name(m) for m in runner.model.modules() if hasattr(m, "linear_method")}
    assert any(CASES[case][1].method in name for name in kernels), kernels
    blocks = Blocks(runner)
    req = make_request("a", PROMPT)
    got = [runner.execute_logits(step(blocks.chunk(req, 0, len(PROMPT))))["a"]]
    for token in (7, 99, 300):  # decode steps: one row per product
        req.append_output_token(token)
        got.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    want = hf_logits(load_hf_model(reference), req.all_token_ids)
    torch.testing.assert_close(torch.cat(got), want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("case", ["gptq4-asym-actorder", "gptq8-sym-channel", "awq4-qwen2", "ct-w4a16-asym-actorder"])
def test_greedy_tokens_match_transformers(case, checkpoints):
    folder, reference = checkpoints(case)
    prompts = [PROMPT[:n] for n in (1, 9, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = LLM(folder, dtype="float32", quantized_activations="float").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(reference, prompts, new_tokens=24)


def test_unquantized_modules_load_their_float_weight(tmp_path):
    """modules_to_not_convert (GPTQ/AWQ) and ignore (compressed-tensors) leave a
    layer in float: its checkpoint holds ``weight`` and the model reads it."""
    base = make_tiny_model(tmp_path / "base", "llama")
    for method in ("gptq", "awq", "compressed-tensors"):
        folder, reference = write_quantized(base, tmp_path / method, Quant(method, sym=False, skip=("mlp.down_proj",)))
        model, _ = load_model(folder)
        down = model.model.layers[1].mlp.down_proj
        assert down.linear_method.kernel_name(down) == "torch"
        ref = load_file(reference / "model.safetensors")
        assert torch.equal(down.weight, ref["model.layers.1.mlp.down_proj.weight"])


@pytest.fixture()
def gptq_copy(checkpoints, tmp_path):
    folder, _ = checkpoints("gptq4-asym-actorder")
    shutil.copytree(folder, tmp_path / "copy")
    return tmp_path / "copy"


def test_missing_tensors_are_named_before_any_is_read(gptq_copy, monkeypatch):
    tensors = load_file(gptq_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.qzeros"], tensors["model.layers.0.mlp.down_proj.g_idx"]
    save_file(tensors, gptq_copy / "model.safetensors")
    read = []
    monkeypatch.setattr("octavo.model.loader._load_tensors", lambda *a: read.append(a))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.0.mlp.down_proj.g_idx', "
                                         r"'model.layers.1.self_attn.k_proj.qzeros'\]"):
        load_model(gptq_copy)
    assert read == []


def test_float_checkpoint_saying_gptq_names_the_quantized_tensors(tmp_path):
    folder = make_tiny_model(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing tensors \[.*qweight.*unexpected tensors \[.*\.weight"):
        load_model(folder)


def test_a_tensor_of_the_wrong_shape_is_named(gptq_copy):
    tensors = load_file(gptq_copy / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.scales"
    tensors[name] = tensors[name][:1]
    save_file(tensors, gptq_copy / "model.safetensors")
    with pytest.raises(ValueError, match=f"tensor that does not fit: {name}"):
        load_model(gptq_copy)


def test_fused_parts_must_be_stored_alike(checkpoints, tmp_path):
    folder, _ = checkpoints("ct-w4a16")
    shutil.copytree(folder, tmp_path / "copy")
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    config["quantization_config"]["ignore"].append("re:.*k_proj$")
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the parts of model.layers.0.self_attn.qkv_proj are stored differently"):
        load_model(tmp_path / "copy")


def test_fused_parts_with_different_act_orders_are_refused(gptq_copy):
    tensors = load_file(gptq_copy / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, gptq_copy / "model.safetensors")
    with pytest.raises(ValueError, match="mlp.gate_up_proj: the fused parts .* have different g_idx"):
        load_model(gptq_copy)


@pytest.mark.parametrize("case", ["gptq4-asym-actorder", "ct-w8a16-asym"])
def test_bfloat16_prefill_and_decode_match_transformers_in_bfloat16(case, checkpoints):
    """bf16 activations take the kernels' many-row path (AMX tiles where the
    CPU has them) for the prefill, and the decode steps the default int8
    activations (Q8_0 rounding): within what bf16 rounding allows of
    transformers run in bf16 on the dequantized weights (the bound the
    unquantized bf16 parity test uses)."""
    folder, reference = checkpoints(case)
    runner = make_runner(folder, dtype="bfloat16")
    blocks = Blocks(runner)
    req = make_request("a", PROMPT[:32])
    got = [runner.execute_logits(step(blocks.chunk(req, 0, 32)))["a"]]
    for token in PROMPT[32:]:
        req.append_output_token(token)
        got.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    want = hf_logits(load_hf_model(reference).to(torch.bfloat16), PROMPT)
    ours = torch.cat(got)
    assert (ours - want).abs().max().item() < 0.05
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9  # random weights: near-ties


def test_on_the_fly_quantization_of_a_quantized_checkpoint_is_refused(checkpoints):
    folder, _ = checkpoints("awq4")
    with pytest.raises(ValueError, match=r"quantization 'int8' quantizes a float checkpoint .* already quantized "
                                         r"\(awq"):
        make_runner(folder, quantization="int8")
