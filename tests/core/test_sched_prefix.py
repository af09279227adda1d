from __future__ import annotations

from core_harness import Run, make_request, make_scheduler, reference_tokens


def _first_start(run: Run, request_id: str) -> int:
    for out in run.steps:
        for s in out.scheduled:
            if s.request_id == request_id:
                return s.start_pos
    raise AssertionError(f"{request_id} never scheduled")


def test_a_shared_prefix_is_computed_once():
    sched, runner = make_scheduler(block_size=16)
    a = make_request("a", 40, max_tokens=2)
    sched.add_request(a)
    run = Run(sched, runner).until_done()
    b = make_request("b", a.prompt_token_ids[:32] + [1, 2, 3, 4, 5], max_tokens=4)
    sched.add_request(b)
    run.until_done()
    assert _first_start(run, "b") == 32
    hit_core = [o for o in run.outputs if o.request_id == "b"][0]
    assert hit_core.num_cached_tokens == 32
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (40 + 37, 32)
    # The runner read a's K/V through b's table: still the reference output.
    assert run.tokens["b"] == reference_tokens(b.prompt_token_ids, 4, "b")


def test_the_last_token_is_always_computed():
    sched, runner = make_scheduler(block_size=16)
    a = make_request("a", 32, max_tokens=1)
    sched.add_request(a)
    run = Run(sched, runner).until_done()
    twin = make_request("twin", list(a.prompt_token_ids), max_tokens=2)
    sched.add_request(twin)
    run.until_done()
    assert _first_start(run, "twin") == 16  # 31 tokens at most: one full block
    assert run.tokens["twin"] == reference_tokens(twin.prompt_token_ids, 2, "twin")


def test_output_blocks_are_cached_for_followups():
    sched, runner = make_scheduler(block_size=4)
    a = make_request("a", 6, max_tokens=8)
    sched.add_request(a)
    run = Run(sched, runner).until_done()
    # A follow-up turn: the old prompt and answer, then more.
    follow = make_request("f", a.prompt_token_ids + run.tokens["a"] + [9, 9], max_tokens=3)
    sched.add_request(follow)
    run.until_done()
    # 6 + 8 tokens, of which 13 have K/V (the last output was never fed): 3 blocks.
    assert _first_start(run, "f") == 12
    assert run.tokens["f"] == reference_tokens(follow.prompt_token_ids, 3, "f")


def test_prompt_logprobs_requests_skip_the_cache():
    sched, runner = make_scheduler(block_size=4)
    a = make_request("a", 12, max_tokens=1)
    sched.add_request(a)
    run = Run(sched, runner).until_done()
    scored = make_request("s", list(a.prompt_token_ids), max_tokens=1, prompt_logprobs=0)
    sched.add_request(scored)
    run.until_done()
    assert _first_start(run, "s") == 0
    assert [lp.logprob for lp in run.prompt_logprobs["s"]] == [-float(p) for p in range(1, 12)]


def test_evicted_prefixes_miss():
    sched, runner = make_scheduler(num_blocks=4, block_size=4)
    a = make_request("a", 9, max_tokens=1)
    sched.add_request(a)
    run = Run(sched, runner).until_done()
    # An unrelated request that needs the whole pool evicts a's blocks.
    sched.add_request(make_request("x", 15, max_tokens=1))
    run.until_done()
    again = make_request("again", list(a.prompt_token_ids), max_tokens=1)
    sched.add_request(again)
    run.until_done()
    assert _first_start(run, "again") == 0
    assert run.tokens["again"] == reference_tokens(again.prompt_token_ids, 1, "again")
