"""GPTQ, AWQ and compressed-tensors checkpoints of tiny mixtures of experts (Mixtral, Qwen2-MoE,
Qwen3-MoE), every expert's projections quantized as a linear layer's (``experts.3.gate_proj.qweight``
...) and the routers float, as the tools write them: the experts run quantized on the int kernels
and the logits equal transformers' on the dequantized weights (within 1e-3, as for dense models),
greedy tokens too; W8A8 experts run what --quantization w8a8 runs; split across tensor-parallel
ranks, the experts' products add up to the whole; experts stored half quantized are refused."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from octavo import LLM, SamplingParams
from octavo.distributed.parallel_state import ParallelState, parallel_state
from octavo.model.config import ExpertsConfig
from octavo.model.layers.moe import FusedMoE
from octavo.model.loader import load_model
from octavo.quant.checkpoint_config import parse_quantization_config
from octavo.quant.prequantized import PrequantizedMoEMethod
from octavo.quant.qweights import quantized_activations
from tests.checkpoint.conftest import octavo_logits
from tests.engine.conftest import hf_greedy
from tests.model_factory import load_hf_model
from tests.quant.quantized_checkpoints import Quant, checkpoint_writer, layer_tensors, quantization_config, quantize
from tests.worker.runner_utils import hf_logits, make_runner

CASES = {
    "gptq4-mixtral": ("mixtral", Quant("gptq", bits=4, sym=True)),
    "gptq4-asym-actorder-qwen2_moe": ("qwen2_moe", Quant("gptq", bits=4, sym=False, act_order=True)),
    "awq4-qwen3_moe": ("qwen3_moe", Quant("awq", bits=4, sym=False)),
    "ct-w4a16-asym-mixtral": ("mixtral", Quant("compressed-tensors", bits=4, sym=False)),
    "ct-w8a16-qwen2_moe": ("qwen2_moe", Quant("compressed-tensors", bits=8, group_size=-1)),
    "ct-w8a8-qwen3_moe": ("qwen3_moe", Quant("compressed-tensors", bits=8, group_size=-1, activations=True,
                                             ct_format="int-quantized")),
}
PROMPT = [random.Random(5).randrange(5, 512) for _ in range(40)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_writer(tmp_path_factory.mktemp("quantized-moe"), CASES)


def _logits(folder, **options) -> tuple[torch.Tensor, list[int]]:
    """PROMPT as one prefill, then 3 decode steps (many-row and one-row expert products), with float
    activations: transformers' dequantized model is the reference (the int8-rounded rows have their
    own tests, tests/quant/test_qdot.py)."""
    return octavo_logits(folder, PROMPT, decode=(7, 99, 300), quantized_activations="float", **options)


@pytest.mark.parametrize("case", [c for c in CASES if "w8a8" not in c])
def test_logits_match_transformers_on_dequantized_weights(case, checkpoints):
    folder, reference = checkpoints(case)
    model = make_runner(folder).model
    experts = {m.weight_method.kernel_name(m) for name, m in model.named_modules() if name.endswith(".experts")}
    assert len(experts) == 1 and next(iter(experts)).startswith(CASES[case][1].method), experts
    assert next(iter(experts)).endswith("(experts)")
    got, tokens = _logits(folder)
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=1e-3, rtol=0)


def test_w8a8_experts_run_what_on_the_fly_w8a8_runs(checkpoints):
    """The checkpoint's int8 experts and scales are those --quantization w8a8 finds in their dequantized
    weights (tests/quant/test_w8a8.py says why), so the logits are equal bit for bit."""
    folder, reference = checkpoints("ct-w8a8-qwen3_moe")
    stored, _ = _logits(folder)
    on_the_fly, _ = _logits(reference, quantization="w8a8")
    assert torch.equal(stored, on_the_fly)


def test_greedy_tokens_match_transformers(checkpoints):
    """Through the engine, prefills chunked beside decodes; every KV block back in the pool after."""
    folder, reference = checkpoints("awq4-qwen3_moe")
    prompts = [PROMPT[:n] for n in (1, 9, 40)]
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=16, quantized_activations="float")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(reference, prompts, new_tokens=24)
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("quant", [
    Quant("gptq", bits=4, sym=False, act_order=True, group_size=16),
    Quant("awq", bits=4, sym=False, group_size=16),
    Quant("compressed-tensors", bits=8, group_size=-1),
], ids=["gptq4-actorder", "awq4", "ct-w8a16"])
def test_experts_split_across_ranks_add_up_to_the_whole(quant):
    """Each rank holds every expert's slice of the intermediate features (gate/up rows packed along
    the outputs for AWQ, act-order groups straddling the ranks for GPTQ); the sum of the ranks'
    products is the mixture of the dequantized experts."""
    experts, hidden, intermediate, names = 3, 64, 32, ("gate_proj", "up_proj", "down_proj")
    fmt = parse_quantization_config({"quantization_config": quantization_config(quant)}).format_for(
        "model.layers.0.mlp.experts.0.gate_proj")
    gen = torch.Generator().manual_seed(0)
    stored, dequantized = {}, {}
    for e in range(experts):
        for proj, shape in zip(names, ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))):
            known = quantize(torch.randn(shape, generator=gen), quant, torch.float16,
                             seed=e if proj != "down_proj" else 100 + e)  # gate and up share one act-order
            stored[f"{e}.{proj}"] = layer_tensors(known, quant, *shape)
            dequantized[f"{e}.{proj}"] = known.dequantized()
    x = torch.randn(5, hidden, generator=gen)
    topk_weights, topk_ids = torch.rand(5, 2, generator=gen), torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    want = torch.zeros_like(x)
    for t in range(5):
        for weight, e in zip(topk_weights[t], topk_ids[t].tolist()):
            act = F.silu(x[t] @ dequantized[f"{e}.gate_proj"].T) * (x[t] @ dequantized[f"{e}.up_proj"].T)
            want[t] += weight * (act @ dequantized[f"{e}.down_proj"].T)
    outs = []
    for rank in range(2):
        with parallel_state(ParallelState(tp_rank=rank, tp_size=2)):
            layer = FusedMoE(ExpertsConfig(experts, 2, intermediate, renormalize=False), hidden, "silu", names,
                             PrequantizedMoEMethod(fmt, fmt))
        for leaf, param in layer.named_parameters():
            for relative, shard in layer.checkpoint_tensors(leaf, set(), "experts").items():
                module, _, tensor = relative.rpartition(".")
                param.weight_loader(param, stored[module][tensor], shard)
        with quantized_activations("float"):  # against the float reference above
            layer.finish_loading()
        outs.append(layer(x, topk_weights, topk_ids))
    torch.testing.assert_close(outs[0] + outs[1], want, atol=1e-4, rtol=1e-4)


def _copy(checkpoints, case, tmp_path):
    folder, _ = checkpoints(case)
    shutil.copytree(folder, tmp_path / "copy")
    return tmp_path / "copy"


def test_a_missing_expert_tensor_is_named(checkpoints, tmp_path):
    folder = _copy(checkpoints, "gptq4-mixtral", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.qzeros"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.mlp\.experts\.2\.w3\.qzeros'\]"):
        load_model(folder)


def test_experts_stored_half_quantized_are_refused(checkpoints, tmp_path):
    folder = _copy(checkpoints, "ct-w8a16-qwen2_moe", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignore"].append(r"re:.*experts\.\d+\.down_proj$")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the experts of model.layers.0.mlp.experts store gate_proj/up_proj quantized "
                                         "but down_proj unquantized"):
        load_model(folder)
