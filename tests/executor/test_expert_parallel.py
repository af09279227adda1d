"""Expert parallelism through worker processes (gloo): with --enable-expert-parallel at tensor-parallel
size 2 each rank holds half the experts, whole, and a tiny Mixtral and Qwen2-MoE (shared expert, a
dense layer) give one process's greedy tokens, their logprobs within 1e-4 (the all-reduce sums the
ranks' shares in another order than one process adds a token's experts), with chunked prefill and
every KV block back in the pool; two pipeline stages of two expert-parallel ranks each give the
same tokens. The routing counts the engine reads from the ranks (one stage's ranks agree, stages hold
their own layers) equal one process's. Rank by rank: tests/model/test_expert_parallel_shards.py."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import random_prompts
from tests.model_factory import make_variant

ENGINE = dict(dtype="float32", block_size=8, max_num_batched_tokens=24)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
PROMPTS = random_prompts([5, 30, 61], seed=8)


def _run(llm: LLM) -> tuple[list[list[int]], list[list[float]], dict[int, list[int]]]:
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        stats = llm.engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp for pos in o.outputs[0].logprobs for _, lp in pos.top] for o in outs]
    return tokens, logprobs, stats.moe_routed_tokens


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_ep2_gives_the_tokens_and_logprobs_of_one_rank(tmp_path_factory, name):
    folder = make_variant(tmp_path_factory.mktemp("ep"), name)
    want_tokens, want_logprobs, want_routes = _run(LLM(folder, **ENGINE))
    tokens, logprobs, routes = _run(LLM(folder, tensor_parallel_size=2, enable_expert_parallel=True,
                                        threads_per_worker=1, **ENGINE))
    assert tokens == want_tokens and routes == want_routes
    assert max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y, strict=True)) < 1e-4


def test_ep2_x_pp2_gives_the_tokens_of_one_rank(tmp_path_factory):
    folder = make_variant(tmp_path_factory.mktemp("ep-pp"), "mixtral")  # a mixture in each stage's one layer
    want_tokens, _, want_routes = _run(LLM(folder, **ENGINE))
    tokens, _, routes = _run(LLM(folder, tensor_parallel_size=2, pipeline_parallel_size=2,
                                 enable_expert_parallel=True, threads_per_worker=1, **ENGINE))
    assert tokens == want_tokens and routes == want_routes and sorted(routes) == [0, 1]
