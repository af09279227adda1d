from __future__ import annotations

import pytest
from core_harness import Run, make_request, make_scheduler, reference_tokens

from octavo.core.request import RequestStatus
from octavo.core.step_results import append_sampled
from octavo.outputs import TokenLogprobs

EOS = 3


def _scripted(script: list[int], **kwargs):
    sched, runner = make_scheduler(block_size=4)
    req = make_request("r", 5, **kwargs)
    runner.script["r"] = script
    sched.add_request(req)
    return Run(sched, runner).until_done(), req


def test_eos_stops_unless_ignored():
    run, req = _scripted([7, EOS, 8, 9], eos_token_id=EOS, max_tokens=4)
    assert run.tokens["r"] == [7, EOS]
    assert (run.finish["r"], run.stop_reason["r"]) == ("stop", None)
    run, _ = _scripted([7, EOS, 8, 9], eos_token_id=EOS, ignore_eos=True, max_tokens=4)
    assert run.tokens["r"] == [7, EOS, 8, 9] and run.finish["r"] == "length"


def test_stop_token_ids_report_the_token():
    run, req = _scripted([7, 8, 9, 10], stop_token_ids=[9, 50], max_tokens=4)
    assert run.tokens["r"] == [7, 8, 9]
    assert (run.finish["r"], run.stop_reason["r"]) == ("stop", 9)
    assert req.stop_reason == 9 and req.status is RequestStatus.FINISHED_STOPPED


def test_a_stop_token_on_the_last_allowed_token_is_a_stop():
    run, _ = _scripted([7, 9], stop_token_ids=[9], max_tokens=2)
    assert run.finish["r"] == "stop"


def test_min_tokens_defers_stop_conditions():
    run, _ = _scripted([EOS, 9, EOS, 9, 5], eos_token_id=EOS, stop_token_ids=[9], min_tokens=3, max_tokens=5)
    # The first two outputs cannot stop; the third (EOS) can.
    assert run.tokens["r"] == [EOS, 9, EOS]
    assert (run.finish["r"], run.stop_reason["r"]) == ("stop", None)


def test_max_tokens_zero_scores_the_prompt_and_samples_nothing():
    sched, runner = make_scheduler(block_size=4, max_num_batched_tokens=16)
    req = make_request("r", 40, max_tokens=0, prompt_logprobs=0)
    sched.add_request(req)
    run = Run(sched, runner).until_done()
    chunks = [(s.start_pos, s.num_tokens, s.sample) for out in run.steps for s in out.scheduled]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, False)]
    assert run.tokens["r"] == [] and run.finish["r"] == "length"
    assert [lp.logprob for lp in run.prompt_logprobs["r"]] == [-float(p) for p in range(1, 40)]
    # Prompt logprobs came with each chunk, the last one with the finish.
    assert [o.finished for o in run.outputs] == [False, False, True]


def test_generation_stops_at_max_model_len():
    sched, runner = make_scheduler(block_size=4, max_model_len=20)
    a = make_request("a", 15, max_tokens=None)
    full = make_request("full", 20, max_tokens=None)
    sched.add_request(a)
    sched.add_request(full)
    run = Run(sched, runner).until_done()
    assert run.tokens["a"] == reference_tokens(a.prompt_token_ids, 5, "a")
    assert len(run.tokens["full"]) == 1
    assert run.finish == {"a": "length", "full": "length"}


def test_generation_stops_where_the_kv_pool_ends():
    sched, runner = make_scheduler(num_blocks=2, block_size=4)
    req = make_request("r", 6, max_tokens=None)
    sched.add_request(req)
    run = Run(sched, runner).until_done()
    assert len(run.tokens["r"]) == 2 and run.finish["r"] == "length"


def test_logprobs_are_passed_on_and_accumulated():
    sched, runner = make_scheduler(block_size=4)
    req = make_request("r", 5, max_tokens=4, logprobs=0)
    sched.add_request(req)
    run = Run(sched, runner).until_done()
    lps = [lp for o in run.outputs for lp in (o.new_logprobs or [])]
    assert [lp.token_id for lp in lps] == run.tokens["r"]
    assert req.cumulative_logprob == pytest.approx(-0.5 * 4)


def test_add_request_rejects_what_can_never_run():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        sched.add_request(make_request("empty", []))
    with pytest.raises(ValueError, match="maximum context length is 20 tokens, you requested 31 tokens"):
        sched.add_request(make_request("long", 21, max_tokens=10))
    with pytest.raises(ValueError, match="prompt_token_ids: 17 tokens need 5 KV cache blocks"):
        sched.add_request(make_request("big", 17))
    sched.add_request(make_request("ok", 16))
    with pytest.raises(ValueError, match="request_id 'ok' is already in use"):
        sched.add_request(make_request("ok", 4))
    assert sched.num_waiting == 1


def test_finish_requests_ends_requests_from_outside():
    sched, runner = make_scheduler(block_size=4)
    req = make_request("r", 5, max_tokens=10)
    sched.add_request(req)
    run = Run(sched, runner)
    run.step()
    sched.finish_requests(["r", "r", "unknown"], RequestStatus.FINISHED_STOPPED)
    assert req.status is RequestStatus.FINISHED_STOPPED and sched.get_request("r") is None
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert sched.schedule().finished_request_ids == {"r"}
    assert not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="status"):
        sched.finish_requests(["r"], RequestStatus.RUNNING)


def test_tokens_after_a_stop_are_dropped():
    req = make_request("r", 3, stop_token_ids=[9], max_tokens=10)
    lps = [TokenLogprobs(t, -1.0, 1) for t in (1, 9, 2)]
    new_ids, new_lps, status = append_sampled(req, [1, 9, 2], lps, max_len=100)
    assert new_ids == [1, 9] and new_lps == lps[:2]
    assert status is RequestStatus.FINISHED_STOPPED and req.all_token_ids[-2:] == [1, 9]
    assert req.cumulative_logprob == -2.0
