"""The pass-key check (benchmarks/needle.py): its prompts hold what they say where they say, and its one engine,
whose Quest page budget is set between passes over prefix-cached prompts, scores the answer exactly as an engine
built with that budget (or a dense one) scores it on the same cached prompts."""
from __future__ import annotations

import re

import pytest

from benchmarks.needle import BLOCK_SIZE, FILLER, Scorer, pass_key
from octavo import LLM, SamplingParams
from octavo.entrypoints.engine_args import MINI_MODEL_PATH
from octavo.sampling_params import StructuredOutputParams
from octavo.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(MINI_MODEL_PATH)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_prompt_holds_the_key_at_its_depth_and_ends_a_token_past_a_block(tokenizer: Tokenizer,
                                                                               depth: float) -> None:
    case = pass_key(tokenizer, 512, depth, seed=3)
    assert len(case.prompt) % BLOCK_SIZE == 1
    assert 512 - BLOCK_SIZE < len(case.prompt) + len(case.forced) <= 512
    text = tokenizer.decode(case.prompt)
    assert text.count(case.key) == 2 and text.endswith("What is the pass key? The pass key")
    assert tokenizer.decode(case.forced) == f" is {case.key}"
    assert tokenizer.decode(case.forced[-case.answer_tokens:]) == f" {case.key}"
    before = text[:text.index(case.key)].count(FILLER.strip())
    after = text[text.index(case.key):].count(FILLER.strip())
    assert round(before / (before + after), 1) == depth


def test_a_context_without_room_for_filler_is_refused(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="context 64 leaves no room"):
        pass_key(tokenizer, 64, 0.5, seed=0)


def test_a_budget_set_between_passes_scores_as_an_engine_built_with_it(tokenizer: Tokenizer) -> None:
    cases = [pass_key(tokenizer, 256, depth, seed) for depth, seed in ((0.2, 0), (0.8, 1))]
    scorer = Scorer(str(MINI_MODEL_PATH), cases, 1, threads_per_worker=1)
    try:
        passes = {top: [s.logprobs for s in scorer.score(top)] for top in (None, 4)}
    finally:
        scorer.llm.shutdown()
    assert passes[None] != passes[4]  # four pages of sixteen read: the answer moves
    for top, mine in passes.items():
        quest = {} if top is None else {"sparse_attention": "quest", "sparse_top_pages": top,
                                        "sparse_recent_pages": 1}
        llm = LLM(str(MINI_MODEL_PATH), max_model_len=256, max_num_seqs=len(cases), threads_per_worker=1, **quest)
        params = [SamplingParams(temperature=0.0, max_tokens=len(c.forced), logprobs=0, structured_outputs=
                                 StructuredOutputParams(regex=re.escape(tokenizer.decode(c.forced))))
                  for c in cases]
        try:
            llm.generate([c.prompt for c in cases], params, use_tqdm=False)  # into the prefix cache
            outputs = llm.generate([c.prompt for c in cases], params, use_tqdm=False)
        finally:
            llm.shutdown()
        theirs = [[lp.logprob for lp in o.outputs[0].logprobs[-c.answer_tokens:]] for o, c in zip(outputs, cases)]
        assert theirs == mine, top
