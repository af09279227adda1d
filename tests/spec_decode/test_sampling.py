"""Sampling parameters apply to the target distribution as without
speculation: greedy runs with penalties, biases, bans, logprobs and every
stop condition give the output of non-speculative decoding, and seeded
random runs reproduce whatever else is batched."""
from __future__ import annotations

import dataclasses

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import assert_no_leak, random_prompts

# Always proposing: these tests are about verification, not about when proposing pays (spec_decode/adaptive.py).
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3,
            speculative_adaptive=False)
LOOPS = [[7, 8, 9, 10] * 6, [40, 41, 42, 43, 44, 45, 46] * 3 + [40, 41], [60, 61] * 9]


@pytest.fixture(scope="module")
def engines(model_dir):
    folder = model_dir("llama")
    plain = LLM(folder, dtype="float32", block_size=4, num_blocks=512)
    spec = LLM(folder, dtype="float32", block_size=4, num_blocks=512, **SPEC)
    return plain, spec


def run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm)
    return [o.outputs[0] for o in outs]


def same_outputs(engines, prompts, params: list[SamplingParams] | SamplingParams) -> None:
    plain, spec = engines
    before = spec.engine.get_stats().spec_num_accepted_tokens
    expected, got = run(plain, prompts, params), run(spec, prompts, params)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert g.text == e.text
        assert (g.finish_reason, g.stop_reason) == (e.finish_reason, e.stop_reason)
        if e.logprobs is not None:
            for a, b in zip(e.logprobs, g.logprobs):
                assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
                assert abs(a.logprob - b.logprob) < 1e-4
    assert spec.engine.get_stats().spec_num_accepted_tokens > before, "no proposal was accepted: nothing tested"


def greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 40)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, **kw)


def test_penalties_bias_and_bans(engines):
    prompts = LOOPS + random_prompts([12, 30])
    params = [
        greedy(repetition_penalty=1.2),
        greedy(presence_penalty=0.3, frequency_penalty=0.2),
        greedy(logit_bias={9: 2.5, 61: -1.0}),
        greedy(allowed_token_ids=list(range(5, 120)) + [7, 8, 9, 10]),
        greedy(),
    ]
    same_outputs(engines, prompts, params)


def test_bad_words_and_min_tokens(engines):
    plain, _ = engines
    tok = plain.get_tokenizer()
    word = tok.decode(run(plain, LOOPS[:1], greedy())[0].token_ids[:2])
    params = [greedy(bad_words=[word]), greedy(min_tokens=20, ignore_eos=False, stop_token_ids=[8, 9, 44])]
    same_outputs(engines, LOOPS[:2], params)


def test_logprobs_of_every_emitted_token(engines):
    same_outputs(engines, LOOPS + random_prompts([20]), greedy(logprobs=3))


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7])
def test_max_tokens_cuts_the_accepted_run(engines, max_tokens):
    plain, spec = engines
    expected = run(plain, LOOPS, greedy(max_tokens=max_tokens))
    got = run(spec, LOOPS, greedy(max_tokens=max_tokens))
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert all(len(g.token_ids) == max_tokens and g.finish_reason == "length" for g in got)


def test_stop_tokens_and_stop_strings_cut_the_accepted_run(engines):
    plain, _ = engines
    free = run(plain, LOOPS, greedy(max_tokens=30))
    params = []
    for out in free:
        # A token and a piece of text from the middle of the free run: the
        # speculative run must stop exactly where the plain one does.
        params.append(greedy(max_tokens=30, stop_token_ids=[out.token_ids[9]]))
        params.append(greedy(max_tokens=30, stop=[out.text[len(out.text) // 2 :][:3]]))
        params.append(greedy(max_tokens=30, stop=[out.text[len(out.text) // 3 :][:2]], include_stop_str_in_output=True))
    prompts = [p for p in LOOPS for _ in range(3)]
    same_outputs(engines, prompts, params)


def test_seeded_runs_reproduce_in_any_batch(engines):
    _, spec = engines
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=1234, max_tokens=40,
                            ignore_eos=True, logprobs=1)
    drafts_before = spec.engine.get_stats().spec_num_drafts
    alone = run(spec, LOOPS[:1], params)[0]
    assert spec.engine.get_stats().spec_num_drafts >= drafts_before + 5  # its proposals were verified
    others = [dataclasses.replace(params, seed=None), dataclasses.replace(params, seed=7), greedy()]
    mixed = run(spec, LOOPS[1:] + random_prompts([25]) + LOOPS[:1], others + [params])
    assert mixed[3].token_ids == alone.token_ids
    assert [lp.logprob for lp in mixed[3].logprobs] == pytest.approx([lp.logprob for lp in alone.logprobs], abs=1e-4)
