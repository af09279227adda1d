"""The engine over a quantized KV cache (int8, fp8): the shipped model's
greedy output, preemption, prefix caching and parallel sampling (n > 1,
copy-on-write of a partly filled block, scales included), no block left
behind, and the option's refusals."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.assets import MINI_MODEL_PATH
from tests.engine.conftest import assert_no_leak, random_prompts, shared_prefix_prompts
from tests.test_mini_model import ENGINE_PROMPTS, GOLDEN_COMPLETION, GOLDEN_NEW_TOKENS

KV = ["int8", "fp8"]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kv", KV)
def test_octavo_mini_greedy_output_is_unchanged(kv):
    """float32 weights: every engine prompt's 32 greedy tokens equal the
    unquantized cache's (measured: 32/32 for each under int8 and fp8), the
    golden prompt's among them. bf16 weights: the golden completion too (the
    third prompt meets a near-tie after 5 tokens under bf16 + int8)."""
    params = SamplingParams(temperature=0, max_tokens=GOLDEN_NEW_TOKENS)
    exact = _tokens(LLM(model=MINI_MODEL_PATH, dtype="float32", num_blocks=64), ENGINE_PROMPTS, params)
    llm = LLM(model=MINI_MODEL_PATH, dtype="float32", num_blocks=64, kv_cache_dtype=kv)
    outs = llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)
    assert outs[0].outputs[0].text == GOLDEN_COMPLETION
    assert [o.outputs[0].token_ids for o in outs] == exact
    assert_no_leak(llm)
    bf16 = LLM(model=MINI_MODEL_PATH, dtype="bfloat16", num_blocks=64, kv_cache_dtype=kv)
    assert bf16.generate([ENGINE_PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text == GOLDEN_COMPLETION


@pytest.mark.parametrize("kv", KV)
def test_preemption_recomputes_into_quantized_blocks(folder, kv):
    prompts = random_prompts([20, 35, 50, 28, 41, 60])
    roomy = LLM(folder, dtype="float32", kv_cache_dtype=kv)
    want = _tokens(roomy, prompts, _greedy(64))
    # 6 requests of up to 124 tokens need ~40 blocks of 16; 16 force preemption.
    tight = LLM(folder, dtype="float32", num_blocks=16, kv_cache_dtype=kv)
    assert _tokens(tight, prompts, _greedy(64)) == want
    assert tight.engine.get_stats().num_preemptions > 0
    assert_no_leak(tight)
    assert_no_leak(roomy)


@pytest.mark.parametrize("kv", KV)
def test_prefix_cache_hits_read_quantized_blocks(folder, kv):
    """A hit on the shared prefix's two full blocks reads them from the
    cache, quantized: the output equals a cold run that reads the same 32
    positions from the cache too (a first chunk of 32, then the rest over
    it). (A cold run in one chunk attends over the prompt's unquantized K/V
    and may differ: measured, one prompt of three after 14 tokens under int8.)"""
    prompts = shared_prefix_prompts()
    cold = LLM(folder, dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False, max_num_batched_tokens=32)
    want = [_tokens(cold, [p], _greedy(32))[0] for p in prompts[1:]]
    llm = LLM(folder, dtype="float32", kv_cache_dtype=kv)
    llm.generate([prompts[0]], _greedy(32), use_tqdm=False)
    rest = llm.generate(prompts[1:], _greedy(32), use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [32, 32, 32]
    assert [o.outputs[0].token_ids for o in rest] == want
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert_no_leak(llm)
    assert_no_leak(cold)


@pytest.mark.parametrize("kv", KV)
def test_parallel_samples_read_copied_blocks_and_scales(folder, kv):
    """n = 3 from a 37-token prompt: the children share two full blocks and
    get copies of the partly filled third (data and scales); each draws
    exactly what its seed draws alone."""
    prompt = random_prompts([37], seed=31)[0]
    group = LLM(folder, dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False)
    out = group.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0]
    alone = LLM(folder, dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False)
    singles = [_tokens(alone, [prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12,
                                                       ignore_eos=True))[0] for i in range(3)]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert [c.token_ids for c in out.outputs] == singles
    assert_no_leak(group)
    assert_no_leak(alone)


def test_bad_kv_cache_dtype_names_the_field(folder):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8; got 'int3'"):
        LLM(folder, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="cache_dtype must then be auto"):
        LLM(folder, kv_cache_dtype="int8", cache_dtype="float32")


def test_cli_refuses_an_unknown_kv_cache_dtype(capsys, tmp_path):
    from octavo.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", str(tmp_path), "--kv-cache-dtype", "int3"])
    assert "--kv-cache-dtype: invalid choice: 'int3'" in capsys.readouterr().err
