"""A fake model runner and helpers for torch-free scheduler tests.

The fake runner keeps a paged "KV cache" of token ids. Each step it applies the
scheduler's block copies, writes every scheduled token into its slot through
the block table, then reads each sampling request's whole context back through
its table and picks the next token as a hash of it. So a wrong block table, a
missing copy-on-write, a bad prefix hit or a recompute that feeds the wrong
tokens all change the output, and the output of a correct schedule equals
``reference_tokens`` (the same hash iterated with no scheduler at all).

With KV cache groups (``windows``) every token is written through each
group's table, and a group of window W reads only the last W positions: the
hash covers what each group reads, so a block released too early (and reused)
changes the output too.
"""
from __future__ import annotations

import zlib
from typing import Optional

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from octavo.core.request import Request
from octavo.core.scheduler import Scheduler
from octavo.core.step_state import BatchState
from octavo.outputs import TokenLogprobs
from octavo.sampling_params import SamplingParams

VOCAB = 97


def salt_of(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


def next_token(context: list[int], salt: int) -> int:
    h = salt
    for t in context:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % VOCAB


def read_by_groups(context: list[int], windows: tuple[Optional[int], ...]) -> list[int]:
    """What the fake model reads of ``context``: per group, all of it or its last window."""
    return [t for w in windows for t in (context if w is None else context[-w:])]


def reference_tokens(prompt: list[int], num_tokens: int, request_id: str,
                     windows: tuple[Optional[int], ...] = (None,)) -> list[int]:
    ctx = list(prompt)
    for _ in range(num_tokens):
        ctx.append(next_token(read_by_groups(ctx, windows), salt_of(request_id)))
    return ctx[len(prompt) :]


def prompt_logprob(position: int) -> float:
    return -float(position)


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, windows: tuple[Optional[int], ...] = (None,)) -> None:
        self.block_size = block_size
        self.windows = windows
        self.slots: list[list[Optional[int]]] = [[None] * block_size for _ in range(num_blocks)]
        # request id -> the tokens it samples, in order, instead of the hash
        # (for stop-condition tests that need exact tokens).
        self.script: dict[str, list[int]] = {}
        # The worker's view of the requests, built from the steps' deltas only.
        self.batch = BatchState()

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Gather all sources first, like a batched tensor copy would.
        copied = [(dst, list(self.slots[src])) for src, dst in out.block_copies]
        for dst, content in copied:
            self.slots[dst] = content
        rows = self.batch.apply(out)
        for s in rows:
            for table in s.block_tables:
                for i, token in enumerate(s.token_ids):
                    b, o = self._slot(table, s.start_pos + i)
                    self.slots[b][o] = token
        result = ModelRunnerOutput()
        for s in rows:
            req = s.request
            end = s.start_pos + s.num_tokens
            ctx = []
            for table, window in zip(s.block_tables, self.windows):
                # Every query of the step reads its window: the first query reaches back furthest.
                first = 0 if window is None else max(0, s.start_pos - window + 1)
                read = [self.slots[b][o] for b, o in (self._slot(table, p) for p in range(first, end))]
                assert None not in read, f"{req.request_id} reads an unwritten slot"
                ctx += read if window is None else read[-window:]
            if s.sample:
                script = self.script.get(req.request_id)
                token = script[req.num_output_tokens] if script else next_token(ctx, salt_of(req.request_id))
                result.sampled_token_ids[req.request_id] = [token]
                if req.sampling_params.logprobs is not None:
                    result.logprobs[req.request_id] = [TokenLogprobs(token, -0.5, 1)]
            if req.sampling_params.prompt_logprobs is not None and s.start_pos < req.num_prompt_tokens:
                # The logits at position p score prompt token p + 1.
                positions = range(s.start_pos + 1, min(end + 1, req.num_prompt_tokens))
                result.prompt_logprobs[req.request_id] = [
                    TokenLogprobs(req.prompt_token_ids[p], prompt_logprob(p), 1) for p in positions
                ]
        return result


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    max_model_len: int = 4096,
    windows: tuple[Optional[int], ...] = (None,),
) -> tuple[Scheduler, FakeRunner]:
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        max_model_len,
        kv_cache_windows=windows,
    )
    return sched, FakeRunner(num_blocks, block_size, windows)


_clock = iter(range(1, 1 << 30))


def make_request(
    request_id: str,
    prompt: list[int] | int,
    priority: int = 0,
    fork_of: Optional[str] = None,
    eos_token_id: Optional[int] = None,
    arrival_time: Optional[float] = None,
    **params,
) -> Request:
    """``prompt`` may be a length: then a prompt of that many tokens derived from the id."""
    if isinstance(prompt, int):
        prompt = [(salt_of(request_id) + 7 * i) % VOCAB for i in range(prompt)]
    params.setdefault("ignore_eos", eos_token_id is None)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        eos_token_id=eos_token_id,
        priority=priority,
        fork_of=fork_of,
        arrival_time=float(next(_clock)) if arrival_time is None else arrival_time,
    )


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.pool
    refs = [pool.ref_cnt(b) for b in range(pool.num_total_blocks)]
    in_use = sum(1 for r in refs if r > 0)
    assert pool.num_free_blocks + in_use == pool.num_total_blocks
    assert set(pool.free_block_ids()) == {b for b, r in enumerate(refs) if r == 0}
    held = 0
    for req in sched.waiting:
        assert kv.get_block_ids(req) == [], f"waiting {req.request_id} holds blocks"
        held += kv.num_held_blocks(req)  # a prefix hit still loading from the KV tiers
    for req in sched.running:
        held += kv.num_held_blocks(req)
    held += sum(1 for load in kv._loads.values() if load.request_id is None)  # loads whose request left
    assert sum(refs) == held
    assert len(sched.running) <= sched.config.max_num_seqs


class Run:
    """Drives a scheduler with the fake runner and records what came out."""

    def __init__(self, sched: Scheduler, runner: FakeRunner) -> None:
        self.sched = sched
        self.runner = runner
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.stop_reason: dict[str, object] = {}
        self.prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.outputs: list[EngineCoreOutput] = []
        self.steps: list[SchedulerOutput] = []

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        check_invariants(self.sched)
        self.steps.append(out)
        for core in self.sched.update_from_output(out, self.runner.execute(out)):
            self.outputs.append(core)
            self.tokens.setdefault(core.request_id, []).extend(core.new_token_ids)
            if core.prompt_logprobs:
                self.prompt_logprobs.setdefault(core.request_id, []).extend(core.prompt_logprobs)
            if core.finished:
                self.finish[core.request_id] = core.finish_reason
                self.stop_reason[core.request_id] = core.stop_reason
        check_invariants(self.sched)
        return out

    def until_done(self, max_steps: int = 2000) -> "Run":
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "scheduler did not drain"
        kv = self.sched.kv_cache_manager
        assert kv.num_free_blocks == kv.num_total_blocks
        return self
