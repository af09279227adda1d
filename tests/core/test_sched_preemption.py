from __future__ import annotations

import pytest
from core_harness import Run, make_request, make_scheduler, reference_tokens

from octavo.core.request import RequestStatus


def _ids(out) -> list[str]:
    return [s.request_id for s in out.scheduled]


def _assert_reference(run: Run, *requests) -> None:
    for r in requests:
        want = reference_tokens(r.prompt_token_ids, r.sampling_params.max_tokens, r.request_id)
        assert run.tokens[r.request_id] == want, r.request_id


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [16, 5])
def test_a_tiny_pool_preempts_and_recompute_gives_the_same_tokens(prefix_caching, budget):
    sched, runner = make_scheduler(
        num_blocks=8, block_size=4, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching
    )
    reqs = [make_request(f"r{i}", 6 + i, max_tokens=12) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    run = Run(sched, runner).until_done()
    assert sched.num_preemptions > 0
    preempted = set().union(*(out.preempted_request_ids for out in run.steps))
    assert preempted and sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    for out in run.steps:
        assert out.preempted_request_ids <= out.finished_request_ids
    _assert_reference(run, *reqs)
    if prefix_caching:
        assert sched.prefix_cache_hits > 0  # recompute reused its own registered blocks


def test_the_victim_is_the_least_urgent_running_request():
    sched, runner = make_scheduler(num_blocks=6, block_size=4)
    a = make_request("a", 7, priority=0, max_tokens=4)
    b = make_request("b", 7, priority=1, max_tokens=4)
    c = make_request("c", 7, priority=1, max_tokens=4)  # same priority as b, arrived later
    for r in (c, b, a):  # insertion order does not matter, (priority, arrival) does
        sched.add_request(r)
    run = Run(sched, runner)
    assert _ids(run.step()) == ["a", "b", "c"]
    assert _ids(run.step()) == ["a", "b", "c"]  # position 7 still fits block 1
    third = run.step()  # position 8 needs a third block each: only two can have one
    assert third.preempted_request_ids == {"c"} and _ids(third) == ["a", "b"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert sched.waiting[0] is c
    run.until_done()
    _assert_reference(run, a, b, c)


def test_the_request_being_scheduled_preempts_itself_when_it_is_the_last():
    sched, runner = make_scheduler(num_blocks=3, block_size=4)
    a = make_request("a", 6, max_tokens=3)
    b = make_request("b", 3, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    run = Run(sched, runner)
    run.step()
    run.step()
    third = run.step()  # b's position 4 needs a block; a holds the rest
    assert third.preempted_request_ids == {"b"} and _ids(third) == ["a"]
    run.until_done()
    _assert_reference(run, a, b)


def test_waiting_queue_is_ordered_by_priority_then_arrival():
    sched, runner = make_scheduler(max_num_seqs=1)
    low = make_request("low", 4, priority=5, max_tokens=1)
    high = make_request("high", 4, priority=0, max_tokens=1)
    mid_late = make_request("mid-late", 4, priority=2, max_tokens=1)
    mid = make_request("mid", 4, priority=2, max_tokens=1, arrival_time=0.0)
    for r in (low, high, mid_late, mid):
        sched.add_request(r)
    run = Run(sched, runner).until_done()
    assert [_ids(out) for out in run.steps] == [["high"], ["mid"], ["mid-late"], ["low"]]


def test_an_urgent_arrival_preempts_less_urgent_running_requests():
    sched, runner = make_scheduler(num_blocks=4, block_size=4)
    low = make_request("low", 12, priority=5, max_tokens=3)
    sched.add_request(low)
    run = Run(sched, runner)
    run.step()
    high = make_request("high", 8, priority=0, max_tokens=2)
    sched.add_request(high)
    out = run.step()
    # low was scheduled for its decode, then un-scheduled to make room.
    assert out.preempted_request_ids == {"low"} and _ids(out) == ["high"]
    run.until_done()
    _assert_reference(run, low, high)


def test_an_equally_urgent_arrival_waits_instead():
    sched, runner = make_scheduler(num_blocks=4, block_size=4)
    first = make_request("first", 12, priority=5, max_tokens=3)
    sched.add_request(first)
    run = Run(sched, runner)
    run.step()
    second = make_request("second", 8, priority=5, max_tokens=2)
    sched.add_request(second)
    out = run.step()
    assert out.preempted_request_ids == set() and _ids(out) == ["first"]
    run.until_done()
    assert sched.num_preemptions == 0
    _assert_reference(run, first, second)


def test_prompt_logprobs_survive_a_mid_prompt_preemption_without_repeats():
    sched, runner = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=16)
    scored = make_request("scored", 40, priority=5, max_tokens=1, prompt_logprobs=1)
    sched.add_request(scored)
    run = Run(sched, runner)
    run.step()
    run.step()
    sched.add_request(make_request("urgent", 9, priority=0, max_tokens=1))
    out = run.step()
    assert out.preempted_request_ids == {"scored"}
    run.until_done()
    got = run.prompt_logprobs["scored"]
    assert [lp.logprob for lp in got] == [-float(p) for p in range(1, 40)]
    assert [lp.token_id for lp in got] == scored.prompt_token_ids[1:]
    assert run.tokens["scored"] == reference_tokens(scored.prompt_token_ids, 1, "scored")
