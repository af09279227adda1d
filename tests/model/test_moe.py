"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3): routing, both checkpoint layouts of the
experts, the error for a missing expert, and greedy output equal to transformers' through the
engine with chunked prefill, prefix sharing, preemption and n > 1. Per-position logits against
transformers are in tests/worker/test_runner_parity.py, with every other architecture."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from octavo import LLM, SamplingParams
from octavo.model.config import ExpertsConfig
from octavo.model.layers.moe import FusedMoE, select_experts
from octavo.model.loader import load_model
from tests.engine.conftest import hf_greedy, random_prompts, shared_prefix_prompts
from tests.model_factory import load_hf_model

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3"]


def test_routing_is_the_softmax_top_k_renormalised_when_asked():
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    probs = [[torch.exp(torch.tensor(v)) / torch.exp(row).sum() for v in row.tolist()] for row in logits]
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 2], [2, 3]]
    expected = torch.tensor([[probs[0][0], probs[0][2]], [probs[1][2], probs[1][3]]])
    torch.testing.assert_close(weights, expected)
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, expected / expected.sum(dim=1, keepdim=True))


def test_an_expert_no_token_chose_is_never_read():
    experts = ExpertsConfig(num_experts=4, top_k=1, intermediate_size=8, renormalize=False)
    layer = FusedMoE(experts, hidden=6, act="silu", names=("gate_proj", "up_proj", "down_proj"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (layer.w13_weight, layer.w2_weight):
            p.copy_(torch.randn(p.shape, generator=gen))
            p[1:] = float("nan")  # experts 1-3: poison
    x = torch.randn(5, 6, generator=gen)
    out = layer(x, torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.int64))
    gate, up = (x @ layer.w13_weight[0].T).chunk(2, dim=-1)
    torch.testing.assert_close(out, (nn.functional.silu(gate) * up) @ layer.w2_weight[0].T)


@pytest.mark.parametrize("name", MOE)
def test_fused_expert_tensors_load_as_the_per_expert_ones(name, variant, tmp_path):
    """The 3-D tensors transformers keeps in memory (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]), saved as they are, give the same model as the per-expert files save_pretrained writes."""
    folder = variant(name)
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    save_file({k: v.contiguous() for k, v in load_hf_model(folder).state_dict().items()},
              str(fused / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(fused / "model.safetensors"))
    (per_expert, _), (whole, _) = load_model(folder), load_model(fused)
    ours, theirs = per_expert.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("name, tensor", [("qwen3_moe", "model.layers.1.mlp.experts.5.up_proj.weight"),
                                          ("deepseek_v3", "model.layers.1.mlp.experts.6.down_proj.weight")])
def test_a_missing_expert_is_a_one_line_error_naming_it(name, tensor, variant, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(variant(name), folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"missing tensors ['{tensor}']")) as error:
        load_model(folder)
    assert "\n" not in str(error.value)


def _greedy(folder, prompts, n: int = 1, **kwargs) -> list[list[list[int]]]:
    llm = LLM(str(folder), dtype="float32", **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=n),
                        use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    return [[c.token_ids for c in o.outputs] for o in outs], stats


@pytest.mark.parametrize("name", MOE)
def test_greedy_output_matches_transformers_through_the_engine(name, variant):
    folder = variant(name)
    prompts = random_prompts([1, 9, 33, 70, 5])
    reference = hf_greedy(folder, prompts, new_tokens=24)
    # Chunked prefill beside decodes, and two samples per prompt.
    tokens, _ = _greedy(folder, prompts, n=2, max_num_batched_tokens=16)
    assert tokens == [[ref, ref] for ref in reference]
    # Blocks for the longest request, not for all at once: preempted and recomputed.
    tokens, stats = _greedy(folder, prompts, num_blocks=13, block_size=8)  # the longest needs 12
    assert stats.num_preemptions > 0 and tokens == [[ref] for ref in reference]


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_prefix_sharing(name, variant):
    folder = variant(name)
    prompts = shared_prefix_prompts()
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([prompts[0]], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts, new_tokens=24)
    assert llm.engine.get_stats().prefix_cache_hits > 0
