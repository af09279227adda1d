"""`octavo serve --moe-expert-metrics` on a tiny Qwen3-MoE: after one completion through the OpenAI client,
/metrics holds, for every sparse layer, the pairs routed to each expert, adding up to top-k per token the
model computed (the prompt and every generated token but the last), and the imbalance gauge those counts
give. Counts against transformers' own routes: tests/engine/test_moe_routing_stats.py."""
from __future__ import annotations

import json

from tests.model_factory import make_variant
from tests.server.conftest import ServerProcess

PROMPT, NEW = list(range(20, 37)), 5


def test_routing_counts_reach_metrics(tmp_path):
    folder = make_variant(tmp_path, "qwen3_moe")
    config = json.loads((folder / "config.json").read_text())
    # transformers 5 writes num_local_experts where older files have num_experts.
    experts, top_k = config.get("num_local_experts", config.get("num_experts")), config["num_experts_per_tok"]
    server = ServerProcess(folder, tmp_path / "server.log", "--moe-expert-metrics", api_key=None)
    try:
        out = server.openai().completions.create(model=server.openai().models.list().data[0].id, prompt=PROMPT,
                                                 max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == NEW
        metrics = server.wait_idle()
    finally:
        server.stop()
    for layer in range(config["num_hidden_layers"]):
        counts = [metrics[f"octavo:moe_expert_tokens_total[expert={e}][layer={layer}]"] for e in range(experts)]
        assert sum(counts) == top_k * (len(PROMPT) + NEW - 1)
        assert metrics[f"octavo:moe_load_imbalance[layer={layer}]"] == max(counts) / (sum(counts) / experts)
