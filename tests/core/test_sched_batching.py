from __future__ import annotations

from core_harness import Run, make_request, make_scheduler, reference_tokens


def _shape(out) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in out.scheduled]


def _assert_reference(run: Run, *requests) -> None:
    for r in requests:
        want = reference_tokens(r.prompt_token_ids, r.sampling_params.max_tokens, r.request_id)
        assert run.tokens[r.request_id] == want, r.request_id
        assert run.finish[r.request_id] == "length"


def test_chunked_prefill_splits_prompts_and_mixes_decodes_with_prefills():
    sched, runner = make_scheduler(max_num_batched_tokens=16)
    a = make_request("a", 40, max_tokens=3)
    b = make_request("b", 10, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    run = Run(sched, runner)
    assert _shape(run.step()) == [("a", 0, 16, False)]
    assert _shape(run.step()) == [("a", 16, 16, False)]
    assert _shape(run.step()) == [("a", 32, 8, True), ("b", 0, 8, False)]
    # Decodes first, then the rest of b's prompt.
    assert _shape(run.step()) == [("a", 40, 1, True), ("b", 8, 2, True)]
    assert _shape(run.step()) == [("a", 41, 1, True), ("b", 10, 1, True)]
    for out in run.steps:
        assert out.total_num_tokens <= 16
        for s in out.scheduled:
            # Deltas: a request known to the workers gets at most the one token
            # sampled since its last step, never its history again.
            assert s.new is not None or len(s.new_token_ids) <= 1
    run.until_done()
    _assert_reference(run, a, b)


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched, runner = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a = make_request("a", 10, max_tokens=3)
    b = make_request("b", 10, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    run = Run(sched, runner)
    assert _shape(run.step()) == [("a", 0, 10, True)]  # b does not fit the 6 left
    assert _shape(run.step()) == [("a", 10, 1, True), ("b", 0, 10, True)]
    run.until_done()
    _assert_reference(run, a, b)


def test_without_chunking_a_prompt_over_the_budget_runs_alone():
    sched, runner = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a = make_request("a", 4, max_tokens=2)
    big = make_request("big", 40, max_tokens=2)
    c = make_request("c", 4, max_tokens=2)
    for r in (a, big, c):
        sched.add_request(r)
    run = Run(sched, runner)
    assert _shape(run.step()) == [("a", 0, 4, True)]  # big waits at the head; c behind it
    assert _shape(run.step()) == [("a", 4, 1, True)]
    assert _shape(run.step()) == [("big", 0, 40, True)]
    assert _shape(run.step()) == [("big", 40, 1, True), ("c", 0, 4, True)]
    run.until_done()
    _assert_reference(run, a, big, c)


def test_max_num_seqs_caps_the_running_set():
    sched, runner = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", 5, max_tokens=3 + i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run = Run(sched, runner)
    assert [s[0] for s in _shape(run.step())] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 1
    run.step()
    run.step()  # r0 finishes here (3 tokens)
    assert [s[0] for s in _shape(run.step())] == ["r1", "r2"]
    run.until_done()
    _assert_reference(run, *reqs)


def test_many_requests_under_a_small_budget_all_match_the_reference():
    sched, runner = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=7, max_num_seqs=5)
    reqs = [make_request(f"r{i}", 3 + 5 * i, max_tokens=4 + i) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    run = Run(sched, runner).until_done()
    assert all(out.total_num_tokens <= 7 for out in run.steps)
    _assert_reference(run, *reqs)
