"""The whole engine at tensor-parallel size 2: two worker processes on gloo,
one thread each, against the same engine at size 1.

One model covers the hard cases at once: Qwen2 (q/k/v biases) with one KV
head for two ranks (replicated) and a vocabulary of 511 rows (odd: the last
rank's shard is padded). Small budgets force chunked prefill, prefix-cache
hits and preemption. The TP=2 engine is started once for the module (a
process per rank costs seconds); the last test kills one of its ranks."""
from __future__ import annotations

import os
import signal
import time

import pytest

from octavo import LLM, SamplingParams
from octavo.executor.base import ExecutorError
from octavo.sampling_params import StructuredOutputParams
from tests.model_factory import make_sentence_transformers_model, make_tiny_model

ENGINE = dict(dtype="float32", num_blocks=12, block_size=8, max_num_batched_tokens=24, max_num_seqs=8)
SHARED = [5, 17, 250, 33, 480, 91, 7, 300, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # two full blocks, shared
PROMPTS = [SHARED + [40], [3, 4], SHARED + [41, 42, 43, 44, 45], list(range(100, 131)), SHARED[:9], [7] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
# Prompt logprobs turn prefix caching off for their request: one only.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3)] + [GREEDY] * 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp"), "qwen2", num_key_value_heads=1, vocab_size=511)


@pytest.fixture(scope="module")
def single(folder):
    return LLM(folder, **ENGINE)


@pytest.fixture(scope="module")
def split(folder):
    llm = LLM(folder, tensor_parallel_size=2, threads_per_worker=1, **ENGINE)
    yield llm
    llm.shutdown()


def _max_logprob_diff(a, b) -> float:
    """Largest difference of the chosen and top tokens' logprobs, outputs and prompt."""
    worst = 0.0
    pairs = list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
    pairs += list(zip(a.prompt_logprobs or [], b.prompt_logprobs or []))
    for x, y in pairs:
        if x is None or y is None:  # the first prompt token has none
            assert x is y
            continue
        assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
        worst = max(worst, abs(x.logprob - y.logprob), *(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)))
    return worst


def test_tp2_matches_tp1_greedy_with_chunks_prefix_hits_and_preemption(single, split):
    want = single.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = split.generate(PROMPTS, PARAMS, use_tqdm=False)
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert _max_logprob_diff(a, b) < 1e-5
    for llm in (single, split):
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert stats.num_free_blocks == stats.num_total_blocks


def test_tp2_grammar_masks_and_seeded_sampling_cross_to_the_driver(single, split):
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputParams(regex=r"[a-c]{3,6}")),
        SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=8, ignore_eos=True),
    ]
    prompts = ["Hello", "Once upon", "abc"]
    want = single.generate(prompts, params, use_tqdm=False)
    got = split.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert 3 <= len(got[0].outputs[0].text) <= 6 and set(got[0].outputs[0].text) <= set("abc")


def test_a_killed_rank_fails_the_engine_within_30_s_naming_it(split):
    proc = split.engine.executor._procs[1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)  # long enough for ZMQ to drop the dead peer: a send to it would block
    start = time.monotonic()
    with pytest.raises(ExecutorError, match="worker rank 1 .*died: killed by signal 9"):
        split.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30


def test_embeddings_at_tp2_match_tp1(tmp_path_factory):
    """Mean-pooled, normalized vectors: each rank pools its hidden states after the all-reduce, so both agree."""
    folder = make_sentence_transformers_model(tmp_path_factory.mktemp("tp-emb"), "mean", arch="qwen2")
    prompts = [SHARED + [40], [3, 4], list(range(100, 131))]
    one = LLM(folder, **ENGINE)
    expected = [o.embedding for o in one.embed(prompts, use_tqdm=False)]
    one.shutdown()
    two = LLM(folder, tensor_parallel_size=2, threads_per_worker=1, **ENGINE)
    try:
        got = [o.embedding for o in two.embed(prompts, use_tqdm=False)]
    finally:
        two.shutdown()
    for a, b in zip(got, expected, strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
