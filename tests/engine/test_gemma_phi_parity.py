"""Gemma 2, Gemma 3 and Phi-3 / Phi-4-mini through the paged engine: greedy
tokens identical to transformers' generate for a batch of prompts longer than
the sliding windows (8 and 12 tokens here, so the windows and the alternation
of sliding and global layers decide the numbers), with chunked prefill, both
attention backends and prefix-cache hits. (Quantized KV caches on these
models: tests/worker/test_kv_quant_runner.py; LongRoPE's long factors:
tests/worker/test_longrope.py; tensor parallelism:
tests/executor/test_tensor_parallel_archs.py.)

Gemma 2's soft caps (attention 2.0, final 4.0) are small enough to bend these
random weights' scores; per-position logits are checked in
tests/worker/test_runner_parity.py (the same variants)."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import assert_no_leak, hf_greedy, random_prompts, shared_prefix_prompts
from tests.model_factory import make_variant

NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
NAMES = ["gemma2", "gemma3", "phi3", "phi4_mini"]
# Several prompts at once; every one but the first outgrows the windows.
LENGTHS = [3, 13, 40, 77, 130]


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma-phi")
    return lambda name: make_variant(root, name)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_batch_with_chunked_prefill_matches_transformers(variant, name, backend):
    folder = variant(name)
    prompts = random_prompts(LENGTHS, seed=3)
    # A 32-token budget: the long prompts are prefilled in chunks beside decodes.
    llm = LLM(folder, dtype="float32", attention_backend=backend, max_num_batched_tokens=32, block_size=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts, NEW)
    assert_no_leak(llm)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_cache_hits_keep_the_output(variant, name):
    """The shared 40-token prefix is read from cached blocks: the global
    layers need all of it, the sliding ones only its tail."""
    folder = variant(name)
    prompts = shared_prefix_prompts()
    llm = LLM(folder, dtype="float32")
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == hf_greedy(folder, prompts, NEW)
    assert all(o.num_cached_tokens >= 32 for o in rest)
    assert_no_leak(llm)
