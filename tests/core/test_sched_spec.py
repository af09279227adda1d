"""Speculative decoding in the scheduler, with the fake runner: proposals ride
as extra decode tokens, rejected ones are rolled back (blocks included), no
unverified token is ever hashed into the prefix cache, preemption drops the
proposals, and outputs stay those of an undisturbed run."""
from __future__ import annotations

import random
import zlib

import pytest
from core_harness import FakeRunner, Run, check_invariants, make_request, make_scheduler, next_token, salt_of

from octavo.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from octavo.core.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.core.scheduler import Scheduler


class SpecFakeRunner(FakeRunner):
    """Verifies proposals greedily against the hash model (reading every
    position's context back through the block table, so a rolled-back slot
    that is read before being rewritten shows) and proposes the hash model's
    continuation with some tokens wrong, chosen by a hash of the context."""

    def __init__(self, num_blocks: int, block_size: int, k: int, wrong_rate: float) -> None:
        super().__init__(num_blocks, block_size)
        self.k = k
        self.wrong_rate = wrong_rate
        self.verified: list[tuple[int, int]] = []  # (proposed, accepted) per verification

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for dst, content in [(dst, list(self.slots[src])) for src, dst in out.block_copies]:
            self.slots[dst] = content
        rows = self.batch.apply(out)
        for s in rows:
            for i, token in enumerate(s.token_ids):
                b, o = self._slot(s.block_ids, s.start_pos + i)
                self.slots[b][o] = token
        result = ModelRunnerOutput()
        for s in rows:
            if not s.sample:
                continue
            req, spec = s.request, s.spec_token_ids
            salt = salt_of(req.request_id)
            last = s.start_pos + s.num_tokens - 1 - len(spec)  # the request's last real token
            emitted = []
            for j in range(len(spec) + 1):
                ctx = [self.slots[b][o] for b, o in (self._slot(s.block_ids, p) for p in range(last + j + 1))]
                assert None not in ctx
                token = next_token(ctx, salt)
                emitted.append(token)
                if j == len(spec) or spec[j] != token:
                    break
            if spec:
                self.verified.append((len(spec), len(emitted) - 1))
            result.sampled_token_ids[req.request_id] = emitted
            result.spec_token_ids[req.request_id] = self._propose(req.all_token_ids + emitted, salt)
        return result

    def _propose(self, context: list[int], salt: int) -> list[int]:
        ctx = list(context)
        out = []
        for _ in range(self.k):
            token = next_token(ctx, salt)
            if zlib.crc32(repr(ctx).encode()) % 1000 < self.wrong_rate * 1000:
                token = (token + 1) % 97
            out.append(token)
            ctx.append(token)
        return out


def spec_scheduler(k: int = 3, wrong_rate: float = 0.3, **kw) -> tuple[Scheduler, SpecFakeRunner]:
    sched, _ = make_scheduler(**kw)
    runner = SpecFakeRunner(sched.kv_cache_manager.num_total_blocks, sched.kv_cache_manager.block_size, k, wrong_rate)
    return sched, runner


def reference(prompt: list[int], n: int, request_id: str) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx, salt_of(request_id)))
    return ctx[len(prompt):]


def test_rejected_proposals_are_rolled_back_with_their_blocks():
    sched, runner = spec_scheduler(k=6, wrong_rate=1.0, block_size=4, num_blocks=16)
    req = make_request("a", 6, max_tokens=20)
    sched.add_request(req)
    run = Run(sched, runner)
    run.step()  # the prompt; the first proposals come back
    assert len(req.spec_token_ids) == 6
    out = run.step()
    (entry,) = out.scheduled
    assert entry.num_tokens == 7 and len(entry.spec_token_ids) == 6
    # Every proposal was wrong (the first one differs): one token came, the
    # 6 proposed positions are rolled back and the blocks past them freed.
    assert runner.verified[-1] == (6, 0)
    kv = sched.kv_cache_manager
    assert req.num_computed_tokens == req.num_tokens - 1 == 7
    assert len(kv.get_block_ids(req)) == 2  # positions 0..6 computed: blocks 0-1
    assert kv.num_free_blocks == kv.num_total_blocks - 2
    run.until_done()
    assert run.tokens["a"] == reference(req.prompt_token_ids, 20, "a")


def test_unverified_tokens_are_never_hashed():
    sched, runner = spec_scheduler(k=8, wrong_rate=1.0, block_size=2, num_blocks=64)
    req = make_request("a", 5, max_tokens=12)
    sched.add_request(req)
    run = Run(sched, runner)
    for _ in range(6):
        run.step()
        pool = sched.kv_cache_manager.pool
        table = sched.kv_cache_manager.get_block_ids(req) if not req.is_finished else []
        for i, block in enumerate(table):
            if pool.block_hash(block) is not None:
                # A registered block holds verified tokens only.
                assert (i + 1) * 2 <= req.num_tokens
    run.until_done()
    # Blocks were registered (the check above was not vacuous), and a new
    # request with the same history finds them.
    again = make_request("b", req.all_token_ids + [1], max_tokens=1)
    _, hits = sched.kv_cache_manager.get_computed_blocks(again)
    assert hits >= 8


def test_proposals_fit_the_budget_max_tokens_and_the_pool():
    sched, runner = spec_scheduler(k=5, wrong_rate=0.0, block_size=4, num_blocks=64, max_num_batched_tokens=4)
    req = make_request("a", 3, max_tokens=3)
    sched.add_request(req)
    run = Run(sched, runner)
    run.step()
    out = run.step()
    # max_tokens 3, one output so far: at most 3 more tokens, so 1 proposal + 1 token.
    assert [len(s.spec_token_ids) for s in out.scheduled] == [1]
    run.until_done()
    assert run.tokens["a"] == reference(req.prompt_token_ids, 3, "a")

    other = make_request("b", 3, max_tokens=30)
    sched.add_request(other)
    run.step()
    out = run.step()
    assert [s.num_tokens for s in out.scheduled] == [4]  # the budget of 4: 3 proposals + the token


def test_short_pool_decodes_plain_and_never_preempts_for_proposals():
    sched, runner = spec_scheduler(k=3, wrong_rate=0.0, block_size=4, num_blocks=3)
    # a: positions 0-2 (one block), b: 0-6 (two): the pool is full, and each
    # next decode fits its last block, but no proposal would.
    a, b = make_request("a", 3, max_tokens=8), make_request("b", 7, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    run = Run(sched, runner)
    run.step()
    assert a.spec_token_ids and b.spec_token_ids
    out = run.step()
    assert [(s.num_tokens, s.spec_token_ids) for s in out.scheduled] == [(1, []), (1, [])]
    assert sched.num_preemptions == 0
    run.until_done()
    assert run.tokens["a"] == reference(a.prompt_token_ids, 8, "a")
    assert run.tokens["b"] == reference(b.prompt_token_ids, 5, "b")


def test_preemption_drops_the_proposals():
    sched, runner = spec_scheduler(k=3, block_size=4, num_blocks=8, max_num_batched_tokens=64)
    low = make_request("low", 9, max_tokens=12, priority=1)
    sched.add_request(low)
    run = Run(sched, runner)
    run.step()
    assert low.spec_token_ids
    sched.add_request(make_request("high", 20, max_tokens=4, priority=0))
    out = run.step()
    assert "low" in out.preempted_request_ids and low.spec_token_ids == []
    run.until_done()
    assert run.tokens["low"] == reference(low.prompt_token_ids, 12, "low")


def test_lookahead_slots_are_reserved_for_a_draft_model():
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=4, num_blocks=32), 32, 4096,
                      SpeculativeConfig(speculative_model="draft", num_speculative_tokens=4))
    req = make_request("a", 6, max_tokens=10)
    sched.add_request(req)
    sched.schedule()
    # 6 prompt tokens + 4 lookahead slots for the draft's own steps: 3 blocks.
    assert len(sched.kv_cache_manager.get_block_ids(req)) == 3


@pytest.mark.parametrize("seed", range(10))
def test_random_workload_with_proposals_matches_the_reference(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    sched, runner = spec_scheduler(
        k=rng.randint(1, 6), wrong_rate=rng.choice([0.0, 0.2, 0.6]),
        num_blocks=rng.randint(5, 8) * 16 // block_size, block_size=block_size,
        max_num_batched_tokens=rng.choice([3, 16, 64]), max_num_seqs=rng.choice([2, 4, 16]),
        enable_prefix_caching=rng.random() < 0.8,
    )
    run = Run(sched, runner)
    shared = [rng.randrange(97) for _ in range(30)]
    live, aborted = [], set()
    for step in range(500):
        if step < 50 and rng.random() < 0.5:
            prompt = shared[: rng.randint(0, 30)] + [rng.randrange(97) for _ in range(rng.randint(1, 20))]
            params = dict(max_tokens=rng.randint(1, 16), priority=rng.randint(0, 2))
            parent = make_request(f"r{step}", prompt, **params)
            group = [parent] + [
                make_request(f"r{step}#{k}", list(prompt), fork_of=parent.request_id,
                             arrival_time=parent.arrival_time, **params)
                for k in range(1, rng.choice([1, 1, 2]))
            ]
            for r in group:
                sched.add_request(r)
            live.extend(group)
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            sched.abort_requests([victim.request_id])
            aborted.add(victim.request_id)
        if not sched.has_unfinished_requests() and step >= 50:
            break
        run.step()
    run.until_done()
    check_invariants(sched)
    for r in live:
        if r.request_id not in aborted:
            assert run.tokens.get(r.request_id, []) == reference(r.prompt_token_ids, r.sampling_params.max_tokens,
                                                                  r.request_id), r.request_id
    proposed = sum(p for p, _ in runner.verified)
    accepted = sum(a for _, a in runner.verified)
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        len(runner.verified), proposed, accepted)
