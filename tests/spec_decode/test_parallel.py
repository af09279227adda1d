"""Speculation across ranks: the proposals travel in the step to every rank
(each computes their positions), the driver rank verifies and proposes;
greedy tokens equal those of one process without speculation."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.model_factory import make_tiny_model

PROMPTS = [[7, 8, 9, 10] * 6, [40, 41, 42, 43, 44] * 4, [100 + i for i in range(19)]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=4, num_blocks=128)


@pytest.mark.parametrize("split", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)])
def test_ranks_verify_the_proposals(tmp_path, split):
    folder = make_tiny_model(tmp_path, "llama", num_hidden_layers=2)
    want = [o.outputs[0].token_ids for o in LLM(folder, **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)]
    llm = LLM(folder, threads_per_worker=1, speculative_method="ngram", num_speculative_tokens=3,
              speculative_adaptive=False, **split, **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == want
        stats = llm.engine.get_stats()
        assert stats.spec_num_accepted_tokens > 0
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()
