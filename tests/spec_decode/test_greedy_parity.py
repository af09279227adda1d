"""Greedy output with n-gram speculation is token for token the output without
it, across the engine's features; no KV block or per-request state is left."""
from __future__ import annotations

import json

import pytest

from octavo import LLM, SamplingParams
from octavo.sampling_params import StructuredOutputParams
from tests.engine.conftest import ARCHS, assert_no_leak, random_prompts, shared_prefix_prompts
from tests.spec_decode.conftest import assert_proposer_state_dropped

NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Always proposing: these tests are about verification, not about when proposing pays (spec_decode/adaptive.py).
SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3, speculative_adaptive=False)


def prompts() -> list[list[int]]:
    """Random prompts, and prompts that repeat themselves (where lookup hits)."""
    loops = [[7, 8, 9, 10] * 6, [40, 41, 42, 43, 44, 45, 46] * 3 + [40, 41]]
    return random_prompts([1, 9, 33, 70]) + loops


def generate(folder, prompt_list, params=GREEDY, **kwargs) -> tuple[list[list[list[int]]], LLM]:
    llm = LLM(folder, **{"dtype": "float32", **kwargs})
    outs = llm.generate(prompt_list, params, use_tqdm=False)
    assert_no_leak(llm)
    assert_proposer_state_dropped(llm)
    return [[c.token_ids for c in o.outputs] for o in outs], llm


def check(folder, prompt_list=None, params=GREEDY, **kwargs) -> LLM:
    """Same tokens with and without speculation; speculation both accepted
    and rejected proposals (so rejected tokens sat in the last block)."""
    prompt_list = prompt_list or prompts()
    plain, _ = generate(folder, prompt_list, params, **kwargs)
    spec, llm = generate(folder, prompt_list, params, **kwargs, **SPEC)
    assert spec == plain
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    return llm


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_and_block_size(model_dir, arch, block_size):
    check(model_dir(arch), block_size=block_size)


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_bfloat16(model_dir, max_num_seqs):
    """In bfloat16 too, where a changed rounding would flip near-ties: the proposals' rows attend through
    the decode kernel as plain decoding's rows do (StepLayout.num_short), so each verified position's
    logits are the ones plain decoding computes."""
    check(model_dir("llama"), dtype="bfloat16", max_num_seqs=max_num_seqs)


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16"}, {"kv_cache_dtype": "int8"}],
                         ids=["float32", "bfloat16", "int8-cache"])
def test_latent_attention(model_dir, options):
    """DeepSeek-V3: the proposals' rows attend over the cached latents through the absorbed decode, each
    as the decode of its token would (StepLayout.num_short), so in bfloat16 too, and over a quantized
    latent cache, speculation gives plain decoding's tokens."""
    check(model_dir("deepseek_v3"), **options)


def test_chunked_prefill_budget_16(model_dir):
    check(model_dir("llama"), max_num_batched_tokens=16)


def test_forced_preemption(model_dir):
    llm = check(model_dir("llama"), num_blocks=14, block_size=8)
    assert llm.engine.get_stats().num_preemptions > 0


def test_prefix_caching(model_dir):
    folder = model_dir("llama")
    shared = shared_prefix_prompts()
    plain, _ = generate(folder, shared)
    llm = LLM(folder, dtype="float32", **SPEC)
    # The first request fills the cache (its outputs too); the rest hit it.
    first = llm.generate(shared[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(shared[1:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == [p[0] for p in plain]
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert_no_leak(llm)


def test_parallel_samples(model_dir):
    check(model_dir("qwen2"), params=SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))


def test_structured_output(model_dir):
    folder = model_dir("llama")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "maxItems": 4,
                       "items": {"enum": ["a", "bb", "a b"]}}},
        "required": ["name", "tags"], "additionalProperties": False,
    }
    spec = StructuredOutputParams(json_schema=schema)
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=spec)
    llm = check(folder, ["Hello, world!", "The quick brown fox", '{"name": "a b a b", "tags": ["a b", "a b"'], params)
    outs = llm.generate(["The quick brown fox"], params, use_tqdm=False)
    json.loads(outs[0].outputs[0].text)  # the grammar was in charge throughout
