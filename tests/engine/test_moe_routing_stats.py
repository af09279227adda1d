"""Routing statistics of mixtures of experts: after a tiny greedy run, the pairs the engine counted per
layer and expert equal a count of transformers' own top-k routes over the same tokens (each prompt and
every generated token but the last, which is never fed back), the imbalance gauge is the busiest
expert's share over the mean of the last window read, and both reach the Prometheus exposition
(the per-expert counter only with --moe-expert-metrics)."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from octavo import LLM, SamplingParams
from octavo.config import CacheConfig
from octavo.engine.stats import EngineStats
from octavo.server.engine_collector import EngineSource, EngineStatsCollector
from tests.engine.conftest import random_prompts
from tests.model_factory import load_hf_model, make_tiny_model, make_variant

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _hand_count(folder, prompts: list[list[int]], outs) -> dict[int, list[int]]:
    """transformers' router logits over each sequence, top-k ids counted per layer and expert."""
    model = load_hf_model(folder)
    config = model.config
    counts: dict[int, torch.Tensor] = {}
    for prompt, out in zip(prompts, outs):
        fed = torch.tensor([prompt + out.outputs[0].token_ids[:-1]])
        with torch.no_grad():
            router_logits = model(fed, output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            ids = logits.topk(config.num_experts_per_tok, dim=-1).indices.flatten()
            counts[layer] = counts.get(layer, 0) + torch.bincount(ids, minlength=logits.shape[-1])
    return {layer: c.tolist() for layer, c in counts.items()}


def _exposed(stats: EngineStats, moe_expert_metrics: bool) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(EngineSource("m", CacheConfig(), lambda: stats, lambda: 0, lambda: None,
                                                        moe_expert_metrics)))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if s.name.startswith("octavo:moe_")}


def _imbalance(counts: list[int]) -> float:
    return max(counts) / (sum(counts) / len(counts))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_counts_equal_transformers_routes_and_reach_metrics(name, tmp_path):
    folder = make_variant(tmp_path, name)
    first, second = random_prompts([7, 19], seed=3), random_prompts([11], seed=4)
    llm = LLM(str(folder), dtype="float32")
    try:
        first_outs = llm.generate(first, PARAMS, use_tqdm=False)
        after_first = llm.engine.get_stats()
        second_outs = llm.generate(second, PARAMS, use_tqdm=False)
        stats = llm.engine.get_stats()
    finally:
        llm.shutdown()
    first_counts, second_counts = _hand_count(folder, first, first_outs), _hand_count(folder, second, second_outs)
    assert after_first.moe_routed_tokens == first_counts
    assert stats.moe_routed_tokens == {layer: [a + b for a, b in zip(c, second_counts[layer])]
                                       for layer, c in first_counts.items()}
    # The gauge covers the window since the previous read: the second run alone.
    for layer, counts in second_counts.items():
        assert stats.moe_load_imbalance[layer] == pytest.approx(_imbalance(counts))

    exposed = _exposed(stats, moe_expert_metrics=True)
    for layer, counts in stats.moe_routed_tokens.items():
        assert exposed[("octavo:moe_load_imbalance", (("layer", str(layer)), ("model_name", "m")))] == \
            pytest.approx(_imbalance(second_counts[layer]))
        for expert, count in enumerate(counts):
            key = ("octavo:moe_expert_tokens_total", (("expert", str(expert)), ("layer", str(layer)), ("model_name", "m")))
            assert exposed[key] == count
    # Without the flag: the per-layer gauge only.
    assert {name for name, _ in _exposed(stats, moe_expert_metrics=False)} == {"octavo:moe_load_imbalance"}


def test_a_dense_model_has_no_routing_stats(tmp_path):
    llm = LLM(str(make_tiny_model(tmp_path)), dtype="float32")
    try:
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
        stats = llm.engine.get_stats()
    finally:
        llm.shutdown()
    assert stats.moe_routed_tokens == {} and stats.moe_load_imbalance == {}
    assert _exposed(stats, moe_expert_metrics=True) == {}
