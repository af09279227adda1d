"""The speculation governor, fed synthetic step costs (no timing here), and
the engine's output staying exact while it switches modes."""
from __future__ import annotations

import random
from typing import Callable

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.spec_decode.adaptive import SpeculationGovernor
from tests.engine.conftest import assert_no_leak, random_prompts
from tests.model_factory import make_tiny_model
from tests.spec_decode.draft_models import noisy_copy


def drive_k(gov: SpeculationGovernor, batch: int, steps: int, cost: Callable[[int], float],
            agreement: list[int]) -> list[int]:
    """Run ``steps`` steady steps: a step proposing k tokens per request costs ``cost(k)``; in one verifying
    k proposals per request, each request accepts as many as it agrees with (``agreement``, cycled over
    the steps' requests), up to k, and emits one more."""
    choices, previous = [], 0
    for step in range(steps):
        k = gov.proposals(batch)
        agreed = [agreement[(step * batch + r) % len(agreement)] for r in range(batch)]
        gov.record([1 + min(previous, a) for a in agreed], cost(k), previous, k)
        choices.append(k)
        previous = k
    return choices


def drive(gov: SpeculationGovernor, batch: int, steps: int, spec_cost: float, plain_cost: float,
          agreement: list[int]) -> list[bool]:
    """Run ``steps`` steady steps of a governor choosing between no proposal and one: a speculating step
    costs ``spec_cost``, a plain one ``plain_cost``."""
    choices = drive_k(gov, batch, steps, lambda k: spec_cost if k else plain_cost, agreement)
    return [k > 0 for k in choices]


def test_keeps_speculating_where_it_pays():
    gov = SpeculationGovernor(1, warmup_steps=4, probe_every=50, probe_steps=3)
    choices = drive(gov, 1, 400, spec_cost=3.0, plain_cost=2.0, agreement=[1])  # 1.5 s/token vs 2
    assert gov.best_proposals(1) == 1
    # After the warm-up of both modes, plain steps are only the periodic probes.
    assert choices[100:].count(False) <= 3 * (300 // 50 + 1)


def test_stops_where_it_does_not_pay_and_decides_per_batch_size():
    gov = SpeculationGovernor(1, warmup_steps=4, probe_every=50, probe_steps=3)
    drive(gov, 1, 200, spec_cost=3.0, plain_cost=2.0, agreement=[1])
    late = drive(gov, 32, 400, spec_cost=9.0, plain_cost=2.5, agreement=[0, 1])  # 9/48 vs 2.5/32 per token
    assert gov.best_proposals(32) == 0 and gov.best_proposals(1) == 1
    assert late[100:].count(True) <= 3 * (300 // 50 + 1)
    assert drive(gov, 1, 20, spec_cost=3.0, plain_cost=2.0, agreement=[1]).count(True) >= 15


def test_notices_when_acceptance_drops():
    gov = SpeculationGovernor(1, warmup_steps=4, probe_every=20, probe_steps=4)
    drive(gov, 1, 200, spec_cost=3.0, plain_cost=2.0, agreement=[1])
    assert gov.best_proposals(1) == 1
    drive(gov, 1, 400, spec_cost=3.0, plain_cost=2.0, agreement=[0] * 9 + [1])  # the text changed: 3/1.1 vs 2
    assert gov.best_proposals(1) == 0


def test_chooses_how_many_to_propose():
    """Each further proposal costs a draft forward and a verified row, and is accepted less often than the
    one before it: the governor settles on the k of the lowest cost per emitted token, here neither none nor
    the most, and keeps it but for its probes."""
    gov = SpeculationGovernor(4, warmup_steps=4, probe_every=50, probe_steps=3)
    agreement = [0, 0, 0, 1, 1, 1, 2, 2, 3, 5]  # how many proposals each request's draft gets right

    def cost(k: int) -> float:
        return 2.0 if k == 0 else 2.6 + 0.5 * k

    per_token = {k: cost(k) / sum(1 + min(k, a) for a in agreement) for k in range(5)}
    best = min(per_token, key=per_token.get)
    assert best not in (0, 4)
    choices = drive_k(gov, len(agreement), 400, cost, agreement)
    assert gov.best_proposals(len(agreement)) == best
    assert choices[200:].count(best) >= 200 - 3 * (200 // 50 + 1)


def test_fewer_proposals_are_judged_on_the_current_text():
    """What k proposals would emit is read from the steps of any larger k too, so the choice follows a
    change of text: from one where only a first proposal is sometimes right to one where all are (probes
    every 20 steps whatever they cost: what they find is the point here)."""
    gov = SpeculationGovernor(3, warmup_steps=4, probe_every=20, probe_steps=4, settle_steps=0, probe_budget=1.0,
                              min_requests=4)

    def cost(k: int) -> float:
        return 2.0 + 0.5 * k

    drive_k(gov, 1, 100, cost, [1, 0, 0])  # a first proposal in three right: 1 pays a little (2.5 / 1.33 < 2)
    assert gov.best_proposals(1) == 1
    drive_k(gov, 1, 200, cost, [3])  # every proposal right: 3 pays most (3.5 / 4 against 3 / 3 for 2)
    assert gov.best_proposals(1) == 3


def test_limits_without_measuring():
    assert not SpeculationGovernor(1, max_batch_size=8).proposals(9)
    always = SpeculationGovernor(3, adaptive=False)
    drive(always, 4, 50, spec_cost=10.0, plain_cost=1.0, agreement=[0])
    assert always.proposals(4) == 3


def test_switching_steps_are_not_measured():
    gov = SpeculationGovernor(1, warmup_steps=1)
    gov.record([1], 100.0, verified=0, proposed=1)  # the first step of speculation
    gov.record([2], 100.0, verified=1, proposed=0)  # the last
    assert gov.best_proposals(1) is None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    target = make_tiny_model(root, "llama")
    return target, noisy_copy(target, root)


def test_greedy_output_exact_while_proposals_start_and_stop(pair):
    """Proposals stop while more than 2 requests decode and start again as
    they finish: every switch keeps the output exact."""
    torch.set_num_threads(1)
    target, draft = pair
    prompts = random_prompts([5, 9, 14, 20, 30])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 20, 30, 40, 50)]
    expected = [o.outputs[0].token_ids for o in LLM(target, dtype="float32").generate(prompts, params,
                                                                                       use_tqdm=False)]
    llm = LLM(target, dtype="float32", speculative_model=str(draft), speculative_max_batch_size=2)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == expected
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0
    assert_no_leak(llm)


def test_one_off_expensive_steps_do_not_decide():
    """A batch size's first steps run eagerly and the next records its kernel tape (~10 plain steps), and
    several such fall in speculation's first steps: the choice follows the steady costs all the same."""
    gov = SpeculationGovernor(1, warmup_steps=8, probe_every=50, probe_steps=3)
    # Speculation's first steps; 3.0 when steady: 1.5 s a token against plain decoding's 2.
    one_offs = iter([30.0] * 8 + [3.0, 30.0, 3.0, 3.0, 30.0, 3.0, 3.0, 3.0])
    drive_k(gov, 1, 200, lambda k: next(one_offs, 3.0) if k else 2.0, agreement=[1])
    assert gov.best_proposals(1) == 1


def test_cost_per_token_is_the_step_cost_over_the_tokens_a_step_emits():
    """Tokens per step vary with acceptance (1 to k + 1): what counts is their mean, not each step's own
    cost per token (a step that emits 1 token would count 4x one that emits 4)."""
    gov = SpeculationGovernor(1, settle_steps=0)
    # A first proposal right every other step: 1.5 tokens per 3 s step on average, 2 s per token.
    drive_k(gov, 1, 200, lambda k: 3.0 if k else 2.2, agreement=[0, 1])
    assert gov.best_proposals(1) == 1  # averaging 3/1 and 3/2 would say 2.25 s per token


def test_probes_are_spaced_by_what_they_cost():
    """Where speculation loses, a probe costs its dearer steps and, for a draft model that sat idle, a
    catch-up on every token decoded meanwhile (its first step): probes come rarely, so that what probing
    spends stays within the budget. Where speculation pays, probing plain decoding costs little and comes
    about every ``probe_every`` steps (its 4 plain steps spend 2 beyond speculation's price, 1% of ~70 steps)."""
    idle = {"steps": 0}

    def losing(k: int) -> float:  # batch 32: a plain step 2.5; speculating 4.0, and its first step catches up
        cost = 2.5 if k == 0 else 4.0 + (0.02 * idle["steps"] if idle["steps"] else 0.0)
        idle["steps"] = idle["steps"] + 1 if k == 0 else 0
        return cost

    gov = SpeculationGovernor(1, warmup_steps=4, settle_steps=0, probe_every=50, probe_steps=4)
    choices = drive_k(gov, 32, 6000, losing, agreement=[0, 0, 1])
    assert gov.best_proposals(32) == 0
    probes = sum(1 for a, b in zip(choices[100:], choices[101:]) if b and not a)
    assert 1 <= probes <= 6000 // 400  # at most one in 400 steps where probe_every alone allows one in 54
    paying = SpeculationGovernor(1, warmup_steps=4, settle_steps=0, probe_every=50, probe_steps=4, min_requests=4)
    choices = drive_k(paying, 1, 2000, lambda k: 3.0 if k else 2.0, agreement=[1])
    assert paying.best_proposals(1) == 1
    probes = sum(1 for a, b in zip(choices[100:], choices[101:]) if a and not b)
    assert probes >= 1900 // 100


def test_choice_moves_on_probes_not_on_old_measurements():
    """The chosen k's cost moves with the contexts and the load; another k's measurement is as old as its
    last probe. Plain decoding chosen at batch 32 grows dearer as the sequences grow, past what speculation
    cost when it was measured: the choice stays, and the next probe, measured beside it, confirms it."""
    growth = {"step": 0}

    def cost(k: int) -> float:
        growth["step"] += 1
        plain = 2.5 * (1 + growth["step"] / 200)  # contexts growing: every step dearer, either way
        return plain * (1.6 if k else 1.0)

    gov = SpeculationGovernor(1, warmup_steps=4, settle_steps=0, probe_every=100, probe_steps=4, probe_budget=1.0)
    choices = drive_k(gov, 32, 400, cost, agreement=[0, 1])  # speculating emits 1.5 tokens: 1.6 / 1.5 > 1
    assert gov.best_proposals(32) == 0
    # Only probes speculated once plain decoding was chosen: a run of probe_steps at most, every probe_every.
    assert sum(choices[40:]) <= 4 * (360 // 100 + 1)


def test_overhead_is_charged_to_the_k_that_causes_it():
    """Output processing and scheduling after a step grow with what it emitted and proposed: a speculating
    step that costs as much as a plain one in the runner but twice as much around it loses."""
    gov = SpeculationGovernor(1, warmup_steps=4, settle_steps=0)
    previous = 0
    for _ in range(60):
        k = gov.proposals(8)
        gov.record([1 + min(previous, 1)] * 8, 2.0 if k else 1.5, previous, k)  # 1.25x plain for 2 tokens
        gov.record_overhead(3.0 if k else 1.0, 8, k)  # ... but (2 + 3) / 2 = 2.5 > 1.5 + 1 per token
        previous = k
    assert gov.best_proposals(8) == 0


def test_batches_passing_through_a_bucket_take_the_nearest_choice():
    """A batch of 32 ramps up through smaller buckets as its prompts are prefilled and down as requests
    finish, a step or two in each: those steps neither measure nor probe (a proposal there makes an idle
    draft catch up on whole sequences); they take the nearest bucket's choice. A bucket measures itself
    once its steps come in a run."""
    gov = SpeculationGovernor(3, warmup_steps=4, probe_every=50, probe_steps=3, min_requests=4)
    assert [gov.proposals(n) for n in (10, 20, 32)] == [0, 0, 0]  # nothing chosen anywhere yet: plain decoding
    drive_k(gov, 32, 400, lambda k: 2.5 * (1 + k), agreement=[0, 1])  # speculation loses at 32
    assert gov.best_proposals(32) == 0
    for _ in range(20):  # runs of 128 steps: ramp up, 32 together (its probes now and then), ramp down
        ramp = [gov.proposals(n) for n in (8, 16, 24)]
        drive_k(gov, 32, 128, lambda k: 2.5 * (1 + k), agreement=[0, 1])
        ramp += [gov.proposals(n) for n in (24, 16, 12, 8, 4, 2)]
        assert ramp == [0] * 9
    for n in (2, 8, 16):
        assert gov.best_proposals(n) is None
    paying = drive_k(gov, 1, 300, lambda k: 2.0 + 0.5 * k, agreement=[3])  # a run at batch 1: measured there
    assert gov.best_proposals(1) == 3 and paying[-100:].count(3) >= 90
    assert [gov.proposals(n) for n in (2, 20)] == [3, 0]  # nearest: bucket 1 for 2, bucket 6 (32-63) for 20


def test_more_proposals_are_measured_only_while_the_most_so_far_pays():
    """Each further proposal is accepted less often than the one before it: where one proposal loses to plain
    decoding, more lose too, and measuring them first would run the dearest steps of all. Where each further
    one pays, the measurement reaches the most."""
    losing = SpeculationGovernor(4, warmup_steps=4, probe_every=1000)
    choices = drive_k(losing, 32, 300, lambda k: 2.5 * (1 + 0.6 * k), agreement=[0, 0, 1])
    assert losing.best_proposals(32) == 0 and set(choices) == {0, 1}
    paying = SpeculationGovernor(4, warmup_steps=4, probe_every=1000)
    choices = drive_k(paying, 1, 300, lambda k: 2.0 + 0.3 * k, agreement=[4])
    assert paying.best_proposals(1) == 4 and choices[-50:] == [4] * 50


def drive_noisy(gov: SpeculationGovernor, steps: int, cost: Callable[[int], float], acceptance: float,
                rng: random.Random, noise: float) -> list[tuple[int, int]]:
    """Run ``steps`` steady steps at batch 1 as a shared machine shows them: a step of k costs ``cost(k)``
    times a swing of up to ``noise`` either way, and each proposal is accepted with chance ``acceptance``
    once the ones before it were. Each step's k and the tokens it emitted."""
    steps_run, previous = [], 0
    for _ in range(steps):
        k = gov.proposals(1)
        accepted = 0
        while accepted < previous and rng.random() < acceptance:
            accepted += 1
        gov.record([1 + accepted], cost(k) * (1 + noise * (2 * rng.random() - 1)), previous, k)
        steps_run.append((k, 1 + accepted))
        previous = k
    return steps_run


def test_noisy_runs_at_batch_1_keep_near_the_best_k():
    """At batch 1 a step's acceptance is one draw and its cost swings with the load: a first choice taken on
    8 steps of each k chose plain decoding in some runs of the shipped draft where speculating pays 1.35x,
    and kept it. Measured in turn over ``min_requests`` request-steps each, and probed again soon where the
    steps off the choice cost less than it, every run decodes within 10% of the best k's cost per token
    once its first measurement is done (here plain decoding costs 30% more than the best)."""
    def cost(k: int) -> float:
        return 2.0 + 0.5 * k

    best = min(cost(k) / sum(0.6 ** i for i in range(k + 1)) for k in range(4))
    for seed in range(20):
        late = drive_noisy(SpeculationGovernor(3), 1000, cost, 0.6, random.Random(seed), noise=0.3)[300:]
        per_token = sum(cost(k) for k, _ in late) / sum(n for _, n in late)
        assert per_token <= 1.1 * best, (seed, per_token / best)


def test_a_larger_k_predicted_to_pay_most_is_measured_next():
    """After plain decoding and one proposal, the acceptance observed predicts what more proposals would emit
    and the two costs where they would cost: every proposal accepted, each adding what the first did, three
    pay most, and they are measured next (two never run) and chosen."""
    gov = SpeculationGovernor(3, probe_every=10**6)
    choices = drive_k(gov, 1, 400, lambda k: 2.0 + 0.5 * k, agreement=[3])
    assert gov.best_proposals(1) == 3 and 2 not in choices and choices[-50:] == [3] * 50


def test_a_change_of_text_brings_a_probe_before_its_time():
    """The chosen k's acceptance is observed every step: when the text turns to one the draft never gets right,
    the choice is probed and left long before ``probe_every`` steps."""
    def cost(k: int) -> float:
        return 2.0 + 0.5 * k

    gov = SpeculationGovernor(3, probe_every=10**6)
    drive_k(gov, 1, 400, cost, agreement=[3])
    assert gov.best_proposals(1) == 3
    after = drive_k(gov, 1, 300, cost, agreement=[0])
    assert gov.best_proposals(1) == 0 and after[-100:].count(0) == 100


def test_first_steps_one_off_costs_do_not_fill_the_probe_budget():
    """A k's first steps run eagerly and record kernel tapes (~1 s of CPU time at batch 1 for the shipped
    draft's four ks): counted as what probing costs, they kept every probe out of the budget for tens of
    thousands of steps. Where speculation pays, probes of plain decoding still come about every
    ``probe_every`` steps."""
    seen = {0: 0, 1: 0}

    def cost(k: int) -> float:
        seen[k] += 1
        return 50.0 if seen[k] <= 8 else (3.0 if k else 2.0)  # one proposal right in every step: 1.5 s a token

    gov = SpeculationGovernor(1, warmup_steps=4, probe_every=50, probe_steps=4, min_requests=4)
    choices = drive_k(gov, 1, 2000, cost, agreement=[1])
    assert gov.best_proposals(1) == 1
    assert sum(1 for a, b in zip(choices[200:], choices[201:]) if a and not b) >= 1800 // 100


def test_a_rival_priced_below_the_choice_is_probed_whatever_the_budget():
    """Chosen where only a first proposal is sometimes right, one proposal observes nothing beyond the first
    position; when the text turns to one the draft copies, the prediction prices three proposals far below
    one, and they are probed and chosen though the budget allows no probe at all."""
    def cost(k: int) -> float:
        return 2.0 + 0.5 * k

    gov = SpeculationGovernor(3, probe_budget=0.0, min_requests=8)
    drive_k(gov, 1, 400, cost, agreement=[1, 0, 0])  # one pays a little (2.5 / 1.33 < 2), more do not
    assert gov.best_proposals(1) == 1
    drive_k(gov, 1, 300, cost, agreement=[3])
    assert gov.best_proposals(1) == 3
