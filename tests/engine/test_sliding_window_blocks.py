"""Sliding-window layers hold only their window's KV blocks: Mistral (every layer slides), Qwen2 with
use_sliding_window (layer 0 global, layer 1 sliding) and Gemma 2 (sliding and global alternate), windows of
32-48 tokens and prompts of 200+. Greedy tokens equal transformers' with chunked prefill, prefix-cache hits
and preemption; a window group's blocks per sequence stay within ceil(window / block_size) + 1 while 300
tokens are generated (replaying recorded decode steps); every block is back in the pool afterwards."""
from __future__ import annotations

import random

import pytest

from octavo import LLM, SamplingParams
from octavo.attention.kv_groups import group_layers
from octavo.model.config import load_arch_config
from tests.engine.conftest import assert_no_leak, hf_greedy
from tests.model_factory import make_tiny_model

BLOCK = 8
MODELS = {
    "mistral": ("mistral", {"sliding_window": 32}),
    "qwen2_sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1}),
    "gemma2": ("gemma2", {"sliding_window": 32}),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            arch, overrides = MODELS[name]
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), arch, **overrides)
        return made[name]

    return get


def _prompts(lengths: list[int], shared: int = 0, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 512) for _ in range(shared)]
    return [prefix + [rng.randrange(5, 512) for _ in range(n - shared)] for n in lengths]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _window_blocks(llm: LLM, request_id: str) -> list[int]:
    """Per window group, the pool blocks the request's table holds."""
    kv = llm.engine.scheduler.kv_cache_manager
    request = llm.engine.scheduler.get_request(request_id)
    return [sum(b != kv.null_block for b in kv.get_block_ids(request, g))
            for g, window in enumerate(kv.windows) if window is not None]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_window_group_holds_one_window_of_blocks_over_300_tokens(model, name):
    folder = model(name)
    llm = LLM(folder, dtype="float32", block_size=BLOCK, max_num_batched_tokens=64)
    window = MODELS[name][1]["sliding_window"]
    bound = -(-window // BLOCK) + 1
    (prompt,) = _prompts([210])
    engine = llm.engine
    engine.add_request("a", prompt, _greedy(300))
    tokens, most = [], 0
    while engine.has_unfinished_requests():
        request = engine.scheduler.get_request("a")
        if request is not None and request.num_output_tokens:  # generating (a prompt chunk adds its blocks)
            held = _window_blocks(llm, "a")
            assert held and max(held) <= bound
            most = max(most, *held)
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert most == bound
    assert tokens == hf_greedy(folder, [prompt], 300)[0]
    # The decodes replayed a recorded step (a CPU kernel tape) reading each group's table.
    assert engine.executor.worker.runner._graphs.recorded_sizes == [1]
    assert_no_leak(llm)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_chunked_prefill_and_prefix_hits_match_transformers(model, name, backend):
    """A 200-token prefix shared by four prompts: the first computes it in 64-token chunks, the others
    hit it (the sliding layers read only its last window's blocks)."""
    folder = model(name)
    prompts = _prompts([205, 230, 260, 217], shared=200)
    llm = LLM(folder, dtype="float32", block_size=BLOCK, max_num_batched_tokens=64, attention_backend=backend)
    first = llm.generate(prompts[:1], _greedy(24), use_tqdm=False)
    rest = llm.generate(prompts[1:], _greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == hf_greedy(folder, prompts, 24)
    assert all(o.num_cached_tokens >= 192 for o in rest)
    assert_no_leak(llm)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_tight_pool_matches_transformers(model, name):
    """Five 200+-token prompts at once, 96 tokens a step, in a pool that holds about one of them whole
    per group: requests are preempted and recompute, and every token stays transformers'."""
    folder = model(name)
    prompts = _prompts([201, 214, 240, 233, 226], seed=9)
    groups = group_layers(load_arch_config(folder).layer_windows)
    num_blocks = len(groups.windows) * (-(-(240 + 24) // BLOCK) + 2)
    llm = LLM(folder, dtype="float32", block_size=BLOCK, max_num_batched_tokens=96, num_blocks=num_blocks)
    outs = llm.generate(prompts, _greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts, 24)
    assert llm.engine.get_stats().num_preemptions > 0
    assert_no_leak(llm)
