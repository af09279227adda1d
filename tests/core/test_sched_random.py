"""Seeded random workloads: arrivals, priorities, parallel-sampling groups,
aborts and a pool small enough to force preemption. Every step checks the
block invariants; every request that was not aborted must end with exactly
the tokens of an undisturbed run."""
from __future__ import annotations

import random

import pytest
from core_harness import Run, make_request, make_scheduler, reference_tokens


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_matches_the_reference(seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 16])
    sched, runner = make_scheduler(
        num_blocks=rng.randint(5, 8) * 16 // block_size,
        block_size=block_size,
        max_num_batched_tokens=rng.choice([3, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 16]),
        enable_chunked_prefill=rng.random() < 0.8,
        enable_prefix_caching=rng.random() < 0.8,
    )
    run = Run(sched, runner)
    shared = [rng.randrange(97) for _ in range(40)]
    live, aborted = [], set()
    for step in range(400):
        if step < 60 and rng.random() < 0.5:
            i = len(live)
            prompt = shared[: rng.randint(0, 40)] + [rng.randrange(97) for _ in range(rng.randint(1, 30))]
            params = dict(max_tokens=rng.randint(0, 12), priority=rng.randint(0, 2))
            if rng.random() < 0.2:
                params["prompt_logprobs"] = 0
            parent = make_request(f"r{i}", prompt, **params)
            group = [parent] + [
                make_request(f"r{i}#{k}", list(prompt), fork_of=parent.request_id,
                             arrival_time=parent.arrival_time, **params)
                for k in range(1, rng.choice([1, 1, 2, 3]))
            ]
            for r in group:
                sched.add_request(r)
            live.extend(group)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            sched.abort_requests([victim.request_id])
            aborted.add(victim.request_id)
        if not sched.has_unfinished_requests() and step >= 60:
            break
        run.step()
    run.until_done()
    for r in live:
        if r.request_id in aborted:
            continue
        want = reference_tokens(r.prompt_token_ids, r.sampling_params.max_tokens, r.request_id)
        assert run.tokens.get(r.request_id, []) == want, r.request_id
        assert run.finish[r.request_id] == "length"
        if r.sampling_params.prompt_logprobs is not None and not r.fork_of:
            got = [lp.logprob for lp in run.prompt_logprobs.get(r.request_id, [])]
            assert got == [-float(p) for p in range(1, r.num_prompt_tokens)], r.request_id
