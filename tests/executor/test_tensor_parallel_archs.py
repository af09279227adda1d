"""Gemma 2, Phi-4-mini's shape, two mixtures of experts and DeepSeek-V3 at tensor-parallel
size 2 (two worker processes on gloo) against transformers' greedy output.

Gemma 2: heads split with their soft-capped scores and alternating windows,
its final soft cap applied to the logits gathered on the driver. Phi-4-mini:
the checkpoint's fused qkv_proj / gate_up_proj cut into q, k, v and gate, up
before each part is sharded, partial rotary, tied embeddings. Mixtral and
Qwen2-MoE: every rank holds a slice of every expert (and of the shared
expert), the router whole, one all-reduce per block. DeepSeek-V3: each
rank its heads' slices of the query, kv_b_proj and o_proj, the whole latent
cache (every head reads it), sigmoid routing with its bias. Small budgets
force chunked prefill, and a shared prefix hits the prefix cache."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts, shared_prefix_prompts
from tests.model_factory import make_variant

NEW = 16


@pytest.mark.parametrize("name", ["gemma2", "phi4_mini", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_tp2_matches_transformers(tmp_path_factory, name):
    folder = make_variant(tmp_path_factory.mktemp("tp-archs"), name)
    prompts = random_prompts([5, 30, 61], seed=8) + shared_prefix_prompts()[:2]
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2, threads_per_worker=1, block_size=8,
              max_num_batched_tokens=24)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        first = llm.generate(prompts[:4], params, use_tqdm=False)
        last = llm.generate(prompts[4:], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first + last] == hf_greedy(folder, prompts, NEW)
        assert last[0].num_cached_tokens >= 32
        stats = llm.engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()
