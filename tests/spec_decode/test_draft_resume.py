"""The draft model while the governor proposes nothing, and when it proposes again: it does not run while off,
catches up on every token decoded meanwhile when it resumes (a request it never saw, its prompt prefilled while
off, from position 0), and greedy output stays plain greedy output across each switch."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.spec_decode.adaptive import SpeculationGovernor
from tests.engine.conftest import assert_no_leak, random_prompts, shared_prefix_prompts
from tests.model_factory import make_tiny_model
from tests.spec_decode.draft_models import noisy_copy

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


class SwitchingGovernor(SpeculationGovernor):
    """A governor whose choices follow ``schedule`` (decision index -> proposals per request), so that the
    switches fall on known steps whatever the steps cost."""

    def __init__(self, num_speculative_tokens: int, schedule) -> None:
        super().__init__(num_speculative_tokens, adaptive=False)
        self.schedule = schedule
        self.decisions = 0

    def proposals(self, batch_size: int) -> int:
        self.decisions += 1
        return self.schedule(self.decisions)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    target = make_tiny_model(root, "llama")
    # The target's own weights: every proposal of a draft that caught up right is accepted.
    return target, noisy_copy(target, root, scale=0.0), noisy_copy(target, root)


def run_switching(target, draft, schedule, prompts_in_turn,
                  **options) -> tuple[list[list[int]], LLM, list[tuple[int, int]]]:
    """Generate each list of prompts in turn (a later one hits the prefix cache the earlier ones filled) under
    ``schedule``; the outputs, the engine and each draft forward's decision index and tokens."""
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=3, **options)
    runner = llm.engine.executor.worker.runner
    governor = runner.governor = SwitchingGovernor(3, schedule)
    model, ran = runner.proposer.model, []
    run, run_rows = model.run, model.run_rows

    def laid_out(input_ids, positions, attn):
        ran.append((governor.decisions, input_ids.numel()))
        return run(input_ids, positions, attn)

    def rows(forward, sample):
        ran.append((governor.decisions, sum(r.num_tokens for r in forward)))
        return run_rows(forward, sample)
    model.run, model.run_rows = laid_out, rows
    outs = []
    for prompts in prompts_in_turn:
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return outs, llm, ran


def plain(target, prompts_in_turn, **options) -> list[list[int]]:
    llm = LLM(target, **options)
    return [o.outputs[0].token_ids for prompts in prompts_in_turn
            for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def on_off_on(decision: int) -> int:
    """Proposing in the first steps, then not for a while (prompts arrive and decode meanwhile), then again."""
    return 0 if 4 < decision <= 30 else 3


CASES = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "float32-chunked-prefill": {"dtype": "float32", "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_greedy_output_exact_across_off_on_switches(models, options):
    """Prompts in three turns: the later ones share a prefix the first filled the cache with, and some arrive
    while proposals are off; with chunked prefill their prompts span steps of both modes."""
    torch.set_num_threads(1)
    target, _, noisy = models
    shared = shared_prefix_prompts()
    turns = [shared[:1] + random_prompts([6, 23]), shared[1:3], shared[3:] + random_prompts([11], seed=3)]
    out, llm, ran = run_switching(target, noisy, on_off_on, turns, **options)
    assert out == plain(target, turns, **options)
    assert not [d for d, _ in ran if on_off_on(d) == 0], "the draft model ran while the governor proposed nothing"
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_num_draft_tokens > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("budget", [2048, 16], ids=["whole", "budget-16"])
def test_draft_catches_up_on_what_it_did_not_see(models, budget):
    """A draft with the target's weights proposes what the target decodes, as long as its cache holds what
    the target's does: resuming after prompts were prefilled and tokens decoded without it (some prompts
    hitting a prefix cached while it was off), every proposal is accepted. Its catch-up stays within the
    step budget, in several forwards where it must."""
    torch.set_num_threads(1)
    target, same, _ = models
    shared = shared_prefix_prompts()
    turns = [shared[:2], shared[2:] + random_prompts([7, 19])]
    off_first = lambda decision: 0 if decision <= 12 else 3  # noqa: E731
    out, llm, ran = run_switching(target, same, off_first, turns, dtype="float32", max_num_batched_tokens=budget)
    assert out == plain(target, turns, dtype="float32", max_num_batched_tokens=budget)
    assert min(d for d, _ in ran) > 12
    assert max(n for _, n in ran) <= budget
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert_no_leak(llm)
