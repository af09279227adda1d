"""Octavo's greedy output equals transformers' generate, whatever the batching does."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import (
    ARCHS,
    NEW_TOKENS,
    PROMPT_LENGTHS,
    hf_greedy,
    random_prompts,
    shared_prefix_prompts,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def run(folder, prompts, **engine_kwargs):
    llm = LLM(folder, dtype="float32", **engine_kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_mixed_lengths_matches_transformers(model_dir, arch, backend):
    folder = model_dir(arch)
    prompts = random_prompts(PROMPT_LENGTHS)
    tokens, _ = run(folder, prompts, attention_backend=backend)
    assert tokens == hf_greedy(folder, prompts)


def test_chunked_prefill_budget_16(model_dir):
    folder = model_dir("llama")
    prompts = random_prompts(PROMPT_LENGTHS)
    tokens, _ = run(folder, prompts, max_num_batched_tokens=16)
    assert tokens == hf_greedy(folder, prompts)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes(model_dir, block_size):
    folder = model_dir("qwen2")
    prompts = random_prompts(PROMPT_LENGTHS[:5])
    tokens, _ = run(folder, prompts, block_size=block_size)
    assert tokens == hf_greedy(folder, prompts)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_and_off(model_dir, prefix_caching):
    folder = model_dir("llama")
    prompts = shared_prefix_prompts()
    llm = LLM(folder, dtype="float32", enable_prefix_caching=prefix_caching)
    # The first request fills the cache; the rest arrive afterwards and can hit it.
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in first + rest]
    assert tokens == hf_greedy(folder, prompts)
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    if prefix_caching:
        assert stats.prefix_cache_hits > 0
        assert rest[0].num_cached_tokens >= 32  # two full 16-token blocks of the prefix
    else:
        assert stats.prefix_cache_hits == 0


def test_preemption_gives_the_same_output(model_dir):
    folder = model_dir("llama")
    prompts = random_prompts([20, 35, 50, 28, 41, 60])
    # 6 requests of up to 124 tokens need ~40 blocks of 16; 16 blocks force preemption.
    tokens, stats = run(folder, prompts, num_blocks=16)
    assert stats.num_preemptions > 0
    assert tokens == hf_greedy(folder, prompts)


def test_rope_scaling_and_tied_embeddings(model_dir):
    folder = model_dir(
        "llama",
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    prompts = random_prompts([5, 90, 150])
    tokens, _ = run(folder, prompts)
    assert tokens == hf_greedy(folder, prompts)
