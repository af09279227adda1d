from __future__ import annotations

from core_harness import Run, check_invariants, make_request, make_scheduler, reference_tokens

from octavo.core.request import RequestStatus


def _all_free(sched) -> bool:
    kv = sched.kv_cache_manager
    return kv.num_free_blocks == kv.num_total_blocks


def _abort(sched, *requests) -> None:
    sched.abort_requests([r.request_id for r in requests])
    check_invariants(sched)
    for r in requests:
        assert r.status is RequestStatus.FINISHED_ABORTED
        assert sched.get_request(r.request_id) is None
        assert sched.kv_cache_manager.get_block_ids(r) == []


def test_abort_while_waiting():
    """A request the workers never saw is not reported to them."""
    sched, runner = make_scheduler(block_size=4)
    req = make_request("w", 8)
    sched.add_request(req)
    _abort(sched, req)
    assert not sched.has_finished_to_send()
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == set()


def test_a_request_the_workers_hold_is_reported_once_when_it_ends():
    """Sent once, then aborted while running: the next
    step, even an empty one, tells the workers to drop its state, once."""
    sched, runner = make_scheduler(block_size=4)
    req = make_request("r", 8)
    sched.add_request(req)
    sched.schedule()
    _abort(sched, req)
    assert sched.has_finished_to_send()
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == {"r"}
    assert not sched.has_finished_to_send()
    assert sched.schedule().finished_request_ids == set()


def test_abort_mid_prefill_and_while_decoding():
    sched, runner = make_scheduler(block_size=4, max_num_batched_tokens=8)
    decoding = make_request("dec", 4, max_tokens=50)  # arrives first
    prefilling = make_request("pre", 20, max_tokens=5)
    sched.add_request(decoding)
    sched.add_request(prefilling)
    run = Run(sched, runner)
    run.step()
    run.step()
    assert 0 < prefilling.num_computed_tokens < 20 and decoding.num_output_tokens == 2
    _abort(sched, prefilling)
    run.step()
    _abort(sched, decoding)
    assert _all_free(sched) and not sched.has_unfinished_requests()


def test_abort_while_preempted():
    sched, runner = make_scheduler(num_blocks=6, block_size=4)
    reqs = [make_request(n, 7, max_tokens=4) for n in ("a", "b", "c")]
    for r in reqs:
        sched.add_request(r)
    run = Run(sched, runner)
    for _ in range(3):
        run.step()
    assert reqs[2].status is RequestStatus.PREEMPTED
    _abort(sched, reqs[2])
    run.until_done()
    assert "c" not in run.finish


def test_abort_a_parent_whose_siblings_wait_then_they_compute_alone():
    sched, runner = make_scheduler(block_size=4, max_num_batched_tokens=8)
    parent = make_request("p", 20, max_tokens=3)
    child = make_request("p#1", list(parent.prompt_token_ids), fork_of="p", max_tokens=3)
    sched.add_request(parent)
    sched.add_request(child)
    run = Run(sched, runner)
    run.step()
    _abort(sched, parent)
    run.until_done()
    assert run.tokens["p#1"] == reference_tokens(child.prompt_token_ids, 3, "p#1")


def test_abort_a_waiting_sibling_and_a_forked_one():
    sched, runner = make_scheduler(block_size=4)
    parent = make_request("p", 10, max_tokens=6)
    kids = [make_request(f"p#{i}", list(parent.prompt_token_ids), fork_of="p", max_tokens=6) for i in (1, 2, 3)]
    for r in (parent, *kids):
        sched.add_request(r)
    _abort(sched, kids[0])  # held, waiting for the parent's prompt
    run = Run(sched, runner)
    run.step()
    assert sched.num_running == 3
    run.step()
    _abort(sched, kids[1])  # running on (partly) shared blocks
    run.until_done()
    for r in (parent, kids[2]):
        assert run.tokens[r.request_id] == reference_tokens(r.prompt_token_ids, 6, r.request_id)


def test_abort_between_schedule_and_update_and_unknown_ids():
    sched, runner = make_scheduler(block_size=4)
    req = make_request("r", 6, max_tokens=4)
    keep = make_request("k", 6, max_tokens=2)
    sched.add_request(req)
    sched.add_request(keep)
    out = sched.schedule()
    result = runner.execute(out)
    _abort(sched, req)
    outputs = sched.update_from_output(out, result)
    assert [o.request_id for o in outputs] == ["k"]
    sched.abort_requests(["r", "never-existed"])
    Run(sched, runner).until_done()
    assert _all_free(sched)


def test_a_request_whose_step_results_fail_ends_with_an_error_alone():
    """The runner reports one request failed, and another's bookkeeping raises:
    both end with "error" and free their blocks; the third finishes normally."""
    sched, runner = make_scheduler(block_size=4)
    reqs = [make_request(n, 6, max_tokens=8) for n in ("ok", "runner", "books")]
    for r in reqs:
        sched.add_request(r)
    run = Run(sched, runner)
    run.step()
    execute = runner.execute

    def failing_execute(out):
        result = execute(out)
        result.failed["runner"] = "sampling failed: boom"
        return result

    runner.execute = failing_execute
    cache_blocks = sched.kv_cache_manager.cache_blocks

    def failing_cache_blocks(request):
        if request.request_id == "books":
            raise RuntimeError("bookkeeping broke")
        cache_blocks(request)

    sched.kv_cache_manager.cache_blocks = failing_cache_blocks
    run.step()
    errors = {o.request_id: o.error for o in run.outputs if o.error is not None}
    assert errors == {"runner": "sampling failed: boom", "books": "RuntimeError: bookkeeping broke"}
    assert reqs[1].status is RequestStatus.FINISHED_ERROR and reqs[2].status is RequestStatus.FINISHED_ERROR
    runner.execute = execute
    run.until_done()
    assert run.finish == {"runner": "error", "books": "error", "ok": "length"}
    assert run.tokens["ok"] == reference_tokens(reqs[0].prompt_token_ids, 8, "ok")
    assert _all_free(sched) and not sched.has_unfinished_requests()
