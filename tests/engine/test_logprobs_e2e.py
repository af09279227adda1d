"""Sampled and prompt logprobs through LLM.generate equal transformers'
log-softmax of the same prefix, however the engine batches, chunks, preempts
or caches."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.outputs import OutputAccumulator, TokenLogprobs
from tests.engine.conftest import assert_no_leak, random_prompts
from tests.model_factory import load_hf_model
from tests.worker.runner_utils import hf_logits

TOL = 1e-4
BLOCKS = 64  # 1024 tokens: ample here, and quick to allocate


@pytest.fixture(scope="module")
def hf(folder):
    return load_hf_model(folder)


def hf_log_softmax(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Row p: transformers' log-probabilities of the token after position p."""
    return torch.log_softmax(hf_logits(hf_model, tokens), dim=-1)


def assert_entry(entry: TokenLogprobs, token: int, row: torch.Tensor, num_top: int) -> None:
    """One position's logprobs against the reference distribution ``row``."""
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(row[token].item(), abs=TOL)
    assert entry.rank == int((row > row[token]).sum()) + 1
    values, ids = row.topk(num_top)
    assert [t for t, _ in entry.top] == ids.tolist()
    assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL)


def assert_prompt_logprobs(hf_model, prompt: list[int], got, num_top: int) -> None:
    assert got is not None and len(got) == len(prompt), "one entry per prompt token"
    assert got[0] is None  # nothing precedes the first token
    ref = hf_log_softmax(hf_model, prompt)
    for pos in range(1, len(prompt)):
        assert_entry(got[pos], prompt[pos], ref[pos - 1], num_top)


def test_sampled_logprobs_match_transformers(folder, hf):
    llm = LLM(folder, dtype="float32", num_blocks=BLOCKS)
    prompts = random_prompts([9, 30, 4], seed=21)
    # Sampled rows choose tokens of every rank, so the ranks are really checked;
    # a batch-wide maximum of 5 must not leak into a request that asked for 2.
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.5, seed=4, max_tokens=10, ignore_eos=True, logprobs=0),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    ranks = []
    for prompt, p, out in zip(prompts, params, outs):
        seq = out.outputs[0]
        assert len(seq.logprobs) == len(seq.token_ids) == 10
        ref = hf_log_softmax(hf, prompt + seq.token_ids)
        for j, (token, entry) in enumerate(zip(seq.token_ids, seq.logprobs)):
            assert_entry(entry, token, ref[len(prompt) - 1 + j], p.logprobs)
            ranks.append(entry.rank)
        assert seq.cumulative_logprob == pytest.approx(sum(e.logprob for e in seq.logprobs), abs=TOL)
        assert out.prompt_logprobs is None  # not asked for
    assert max(ranks) > 1, "sampling should pick some tokens that are not the most likely"
    assert_no_leak(llm)


@pytest.mark.parametrize("budget", [2048, 16])
def test_prompt_scoring_with_max_tokens_zero(folder, hf, budget):
    """lm-eval style loglikelihood: echo the prompt, generate nothing. With a
    budget of 16 the longer prompts are scored across several chunks."""
    llm = LLM(folder, dtype="float32", num_blocks=BLOCKS, max_num_batched_tokens=budget)
    prompts = random_prompts([2, 17, 40], seed=22)
    params = SamplingParams(max_tokens=0, prompt_logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        seq = out.outputs[0]
        assert seq.token_ids == [] and seq.text == ""
        assert seq.finish_reason == "length"
        assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 3)
    assert_no_leak(llm)


def test_parallel_sampling_reports_prompt_logprobs_once(folder, hf):
    llm = LLM(folder, dtype="float32", num_blocks=BLOCKS)
    prompt = random_prompts([21], seed=23)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 1)
    assert_no_leak(llm)


def test_prompt_logprobs_not_duplicated_by_preemption(folder, hf):
    # Four requests of up to 70 tokens want 20 blocks of 16; 8 blocks and
    # 24-token chunks force preemptions, some in the middle of a prompt.
    llm = LLM(folder, dtype="float32", num_blocks=8, max_num_batched_tokens=24)
    prompts = random_prompts([40, 45, 50, 38], seed=24)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 2)
    assert_no_leak(llm)


def test_prompt_logprobs_skip_the_prefix_cache(folder, hf):
    llm = LLM(folder, dtype="float32", num_blocks=BLOCKS, enable_prefix_caching=True)
    prompt = random_prompts([50], seed=25)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], plain, use_tqdm=False)  # fills the cache
    scored = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    assert_prompt_logprobs(hf, prompt, scored.prompt_logprobs, 0)
    # The cache was really there: a plain request hits it.
    again = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens == 48
    assert_no_leak(llm)


def test_prompt_logprobs_requests_still_fill_the_prefix_cache(folder, hf):
    """They cannot read it (a cached position has K/V but no logits: vLLM skips reading for them too),
    but the blocks they compute serve the requests after them."""
    llm = LLM(folder, dtype="float32", num_blocks=BLOCKS, enable_prefix_caching=True)
    prompt = random_prompts([50], seed=26)[0]
    scored = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert_prompt_logprobs(hf, prompt, scored.prompt_logprobs, 1)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 48
    assert_no_leak(llm)


def test_one_token_prompt_has_one_empty_entry(folder):
    """Nothing scores a one-token prompt, yet its prompt_logprobs hold one entry
    per prompt token, [None], as vLLM's do; a request that did not ask has None."""
    llm = LLM(folder, dtype="float32", num_blocks=BLOCKS)
    prompt = random_prompts([1], seed=24)[0]
    for kind in ("final_only", "delta"):
        for max_tokens, asked in ((0, 2), (3, 0), (3, None)):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=asked, output_kind=kind)
            llm.engine.add_request("one", prompt, params)
            folded = OutputAccumulator(prompt)
            while llm.engine.has_unfinished_requests():
                for out in llm.engine.step():
                    folded.add(out)
            assert folded.take().prompt_logprobs == ([None] if asked is not None else None), (kind, max_tokens)
    assert_no_leak(llm)
