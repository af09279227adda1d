from __future__ import annotations

import pytest
from core_harness import Run, make_request, make_scheduler, reference_tokens

from octavo.core.request import RequestStatus


def _group(prompt_len: int, n: int, **params):
    parent = make_request("p", prompt_len, **params)
    children = [
        make_request(f"p#{i}", list(parent.prompt_token_ids), fork_of="p", arrival_time=parent.arrival_time, **params)
        for i in range(1, n)
    ]
    return parent, children


def _used(sched) -> int:
    kv = sched.kv_cache_manager
    return kv.num_total_blocks - kv.num_free_blocks


def _assert_reference(run: Run, *requests) -> None:
    for r in requests:
        want = reference_tokens(r.prompt_token_ids, r.sampling_params.max_tokens, r.request_id)
        assert run.tokens[r.request_id] == want, r.request_id


def test_siblings_share_the_prompt_and_copy_only_the_partial_block():
    sched, runner = make_scheduler(num_blocks=32, block_size=16)
    parent, children = _group(40, 4, max_tokens=5)
    for r in (parent, *children):
        sched.add_request(r)
    run = Run(sched, runner)
    first = run.step()
    assert [s.request_id for s in first.scheduled] == ["p"]  # siblings wait
    # The parent's prompt is done: the siblings joined, sharing its 3 blocks.
    kv = sched.kv_cache_manager
    table = kv.get_block_ids(parent)
    assert _used(sched) == 3 and sched.num_running == 4
    assert all(kv.get_block_ids(c) == table for c in children)
    assert [kv.pool.ref_cnt(b) for b in table] == [4, 4, 4]

    second = run.step()
    assert [(s.request_id, s.start_pos, s.num_tokens) for s in second.scheduled] == [
        ("p", 40, 1), ("p#1", 39, 1), ("p#2", 39, 1), ("p#3", 39, 1)
    ]
    # Four writers of the partial block: three copies, the last one writes in place.
    assert [src for src, _ in second.block_copies] == [table[2]] * 3
    assert _used(sched) == 3 + 3
    assert [kv.pool.ref_cnt(b) for b in table] == [4, 4, 1]
    assert all(c.num_cached_tokens == 39 for c in children)
    run.until_done()
    # Each sibling has its own stream (the fake model salts by id), read
    # through its own table: a missing or wrong copy would change it.
    _assert_reference(run, parent, *children)


def test_a_prompt_of_whole_blocks_copies_the_last_full_block():
    sched, runner = make_scheduler(num_blocks=32, block_size=16)
    parent, children = _group(32, 3, max_tokens=4)
    for r in (parent, *children):
        sched.add_request(r)
    run = Run(sched, runner)
    run.step()
    assert _used(sched) == 2
    second = run.step()
    # The parent writes position 32 into a new block; both siblings rewrite
    # position 31 of the shared block 1, which the parent keeps: two copies.
    assert len(second.block_copies) == 2
    assert _used(sched) == 2 + 1 + 2
    run.until_done()
    _assert_reference(run, parent, *children)


def test_a_parent_that_finishes_at_its_first_token_still_hands_over_its_blocks():
    sched, runner = make_scheduler(num_blocks=16, block_size=16)
    parent, children = _group(40, 3, max_tokens=1)
    for r in (parent, *children):
        sched.add_request(r)
    run = Run(sched, runner)
    run.step()
    assert run.finish["p"] == "length" and sched.num_running == 2
    assert _used(sched) == 3  # held by the two siblings now
    run.until_done()
    _assert_reference(run, parent, *children)


def test_siblings_without_a_free_seat_compute_their_prompt():
    sched, runner = make_scheduler(num_blocks=32, block_size=16, max_num_seqs=2)
    parent, children = _group(40, 3, max_tokens=3)
    for r in (parent, *children):
        sched.add_request(r)
    run = Run(sched, runner)
    run.step()
    assert sched.num_running == 2 and children[1].status is RequestStatus.WAITING
    run.until_done()
    late_start = next(s.start_pos for out in run.steps for s in out.scheduled if s.request_id == children[1].request_id)
    assert late_start == 32  # a plain prefix hit on the parent's full blocks
    _assert_reference(run, parent, *children)


def test_siblings_fall_back_when_the_parent_is_preempted_before_its_prompt_is_done():
    sched, runner = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=16)
    parent, children = _group(20, 2, priority=5, max_tokens=2)
    for r in (parent, *children):
        sched.add_request(r)
    run = Run(sched, runner)
    run.step()  # parent's first chunk
    sched.add_request(make_request("urgent", 12, priority=0, max_tokens=1))
    out = run.step()  # the urgent chunk needs blocks the parent's last chunk took
    assert out.preempted_request_ids == {"p"}
    run.until_done()
    child_first = next(s for out in run.steps for s in out.scheduled if s.request_id == children[0].request_id)
    assert child_first.start_pos != 19  # computed its prompt, not forked
    _assert_reference(run, parent, *children)


def test_fork_of_an_unknown_parent_computes_normally_and_prompts_must_match():
    sched, runner = make_scheduler(block_size=4)
    orphan = make_request("o#1", 6, fork_of="gone", max_tokens=2)
    sched.add_request(orphan)
    run = Run(sched, runner).until_done()
    assert run.tokens["o#1"] == reference_tokens(orphan.prompt_token_ids, 2, "o#1")
    parent = make_request("q", 6, max_tokens=2)
    sched.add_request(parent)
    with pytest.raises(ValueError, match="fork_of"):
        sched.add_request(make_request("q#1", 7, fork_of="q"))
    run.until_done()
