"""Iteration-level scheduler: one token budget per step shared by decodes and
prompt chunks, with prefix reuse, preemption by recompute and priorities.

There are no prefill or decode phases. Every request has ``num_tokens`` (prompt
plus outputs) and ``num_computed_tokens``; a step hands each running request
the tokens it still lacks (one, for a decoding request), in order of urgency,
then admits waiting requests while the budget, ``max_num_seqs`` and the KV
pool allow. Choices worth knowing:

- Urgency is ``(priority, arrival_time)``, lower first, for both queues. When a
  running request cannot grow, the least urgent running request is preempted
  (possibly itself): its blocks are freed and it recomputes later from
  ``all_token_ids``. A waiting request preempts running ones only when its
  priority value is strictly lower; equal priorities queue first-come
  first-served, so requests never evict each other back and forth.
- Admission is in order: when the queue head cannot be admitted, nothing behind
  it is (no starvation of long prompts). A request whose prefix hit is being
  read from disk (the KV tiers) is passed over until the read is done, while
  other requests run and are admitted.
- ``max_tokens=0`` (prompt scoring): the prompt is computed with ``sample``
  off and the request finishes with "length" once it is.
- Lengths stop at ``min(max_model_len, whole pool)`` (shared by the KV cache
  groups: each may need a table as long as the request in a prompt's step), so
  a request alone always fits and preemption always lets the most urgent
  request progress.
- Only running requests hold blocks. Parallel-sampling siblings wait until
  their parent's prompt is computed, then join the running set sharing its
  blocks, if a seat is free; otherwise (or if the parent left first) they
  compute their prompt like any request. The parent reports prompt logprobs.
- Speculative decoding: a decoding request's proposals (``Request.
  spec_token_ids``, from the previous step) ride along as extra tokens of its
  decode, cut to the budget left, to ``max_tokens`` and to the context; when
  the pool cannot hold them the request decodes plain (proposals never cause
  a preemption). ``num_computed_tokens`` counts them until the results say
  how many were accepted; the rest are rolled back, with the blocks they
  alone filled (``_apply_verification``). Preemption drops them.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from octavo.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from octavo.core.request import Request, RequestStatus
from octavo.core.request_queue import RequestQueue, SortKey
from octavo.core.spec_stats import SpecDecodingStats
from octavo.core.step_results import append_sampled, take_prompt_logprobs
from octavo.core.step_state import SentRequests
from octavo.kv_offload.index import TierIndex

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    """What one ``schedule()`` call has decided so far."""

    budget: int
    used: int = 0
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)

    @property
    def left(self) -> int:
        return max(0, self.budget - self.used)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        speculative_config: Optional[SpeculativeConfig] = None,
        kv_cache_windows: Sequence[Optional[int]] = (None,),
        kv_offload: Optional[TierIndex] = None,
    ) -> None:
        """``kv_cache_windows``: per KV cache group of the model, its sliding window
        (None: it keeps every position); see ``KVCacheManager``. ``kv_offload``: the
        tiers below the KV pool (host memory, disk), if any."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.config = scheduler_config
        self.max_model_len = max_model_len
        spec = speculative_config or SpeculativeConfig()
        if spec.speculative_model is not None:
            # A draft model's cache is indexed by the first group's tables and read whole: no group releases.
            kv_cache_windows = (None,) * len(kv_cache_windows)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_cache_windows, kv_offload
        )
        self._block_size = cache_config.block_size
        self._num_groups = self.kv_cache_manager.num_groups
        self._max_len = min(max_model_len, num_blocks // self._num_groups * cache_config.block_size)
        self._requests: dict[str, Request] = {}
        self._order: dict[str, SortKey] = {}
        self._counter = itertools.count()
        self.waiting = RequestQueue(self._sort_key)
        self.running = RequestQueue(self._sort_key)
        self._fork_waiters: dict[str, list[Request]] = {}  # parent id -> held siblings
        self._finished_ids: set[str] = set()
        self._sent = SentRequests(cache_config.block_size)  # what the workers hold of each request
        self.num_preemptions = 0
        self._num_lookahead = spec.num_lookahead_slots
        self.spec_stats = SpecDecodingStats()

    def _sort_key(self, request: Request) -> SortKey:
        return self._order[request.request_id]

    # ---- requests -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError for one that could never run."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if num_prompt > self.max_model_len:
            max_tokens = request.sampling_params.max_tokens or 0
            raise ValueError(
                f"maximum context length is {self.max_model_len} tokens, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} to generate)"
            )
        needed = -(-num_prompt // self._block_size) * self._num_groups
        total = self.kv_cache_manager.num_total_blocks
        if needed > total:
            raise ValueError(
                f"prompt_token_ids: {num_prompt} tokens need {needed} KV cache blocks, "
                f"the cache has {total} ({total * self._block_size} tokens)"
            )
        parent = self._requests.get(request.fork_of) if request.fork_of else None
        if parent is not None and parent.prompt_token_ids != request.prompt_token_ids:
            raise ValueError(f"fork_of: request {rid!r} must have the prompt of {parent.request_id!r}")
        self._order[rid] = (request.priority, request.arrival_time, next(self._counter))
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self.waiting.add(request)
        if parent is not None and parent.num_computed_tokens < parent.num_prompt_tokens:
            self._fork_waiters.setdefault(parent.request_id, []).append(request)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Cancel requests in any state; their blocks return to the pool now."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (stop strings, aborts). Unknown or already
        finished ids are ignored: they may have finished in the same step."""
        if not status.finished:
            raise ValueError(f"status must be a finished status, got {status}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None:
                self._finish(request, status)

    def get_request(self, request_id: str) -> Optional[Request]:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        # Loads from disk outlive an aborted request: steps must go on until they end and free their blocks.
        return bool(self._requests) or self.kv_cache_manager.loads_in_flight

    def has_finished_to_send(self) -> bool:
        """Requests that ended since the last step, which the workers still hold
        state for (token ids, block table, generator): the next step, even an
        empty one, tells them to drop it."""
        return bool(self._finished_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits

    # ---- schedule -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        self._schedule_waiting(step)
        finished = self._finished_ids | step.preempted
        self._finished_ids = set()
        return SchedulerOutput(
            scheduled=list(step.scheduled.values()),
            block_copies=self.kv_cache_manager.take_block_copies(),
            finished_request_ids=finished,
            preempted_request_ids=step.preempted,
            kv_transfers=self.kv_cache_manager.take_kv_transfers(),
            kv_loads_in_flight=self.kv_cache_manager.loads_in_flight,
        )

    def _schedule_running(self, step: _Step) -> None:
        i = 0
        while i < len(self.running) and step.left > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, step.left)
            if n > 0:
                spec = self._fit_proposals(request, n, step)
                if not spec and not self._allocate_running(request, n, step):
                    break  # it was the least urgent, so the last one
                self._add_scheduled(request, n, step, spec)
            i += 1

    def _fit_proposals(self, request: Request, n: int, step: _Step) -> list[int]:
        """The request's proposals that fit this step, their KV slots (and
        the proposer's lookahead) allocated; empty when none fit. Taken off
        the request either way: proposals are for the step right after theirs."""
        spec, request.spec_token_ids = request.spec_token_ids, []
        if not spec or n != 1:
            return []  # only a decode carries proposals (a resumed request recomputes first)
        params = request.sampling_params
        room = [len(spec), step.left - n, self._max_len - request.num_tokens]
        if params.max_tokens is not None:
            # The verification emits up to len(spec) + 1 tokens.
            room.append(params.max_tokens - request.num_output_tokens - 1)
        k = max(0, min(room))
        end = request.num_computed_tokens + n + k
        lookahead = self._lookahead(request, end)
        if k and self.kv_cache_manager.allocate_slots(request, n + k, num_lookahead_tokens=lookahead):
            return spec[:k]
        return []

    def _lookahead(self, request: Request, end: int) -> int:
        """Scratch slots for the proposer past position ``end`` (where this
        step's tokens for the request stop): only when the step samples,
        and never past the longest context, so a request alone still fits."""
        if not self._num_lookahead or end < request.num_tokens:
            return 0
        return max(0, min(self._num_lookahead, self._max_len - end))

    def _allocate_running(self, request: Request, n: int, step: _Step) -> bool:
        # Victims come from the back of the running queue, which this loop has
        # not reached yet, so nothing already scheduled is undone here.
        lookahead = self._lookahead(request, request.num_computed_tokens + n)
        while not self.kv_cache_manager.allocate_slots(request, n, num_lookahead_tokens=lookahead):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, step: _Step) -> None:
        # Walks from the head and stops at the first request that cannot be
        # admitted, so a step looks at the requests it admits or passes over
        # and one more, however long the queue (no copy of it either).
        # Admitting removes the request at ``i``; a request it preempts sorts
        # behind it, so the positions before ``i`` never change.
        i = 0
        while i < len(self.waiting):
            request = self.waiting[i]
            if step.left == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if self._is_held(request):
                i += 1
                continue
            if request.request_id in step.preempted:
                return  # it just left; the runner must see it gone for a step
            computed, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            if self.kv_cache_manager.is_loading(request):
                i += 1
                continue  # its prefix hit is being read from disk meanwhile: the requests behind it go ahead
            n = request.num_tokens - num_hit
            if n > step.left:
                if self.config.enable_chunked_prefill:
                    n = step.left
                elif step.scheduled or n <= self.config.max_num_batched_tokens:
                    return  # waits for a step with room for all of it
                # else: longer than any budget, so it runs alone, whole.
            if not self._allocate_waiting(request, n, computed, num_hit, step):
                return
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            self.running.add(request)
            self._add_scheduled(request, n, step)

    def _allocate_waiting(self, request: Request, n: int, computed: list[list[int]], num_hit: int, step: _Step
                          ) -> bool:
        lookahead = self._lookahead(request, num_hit + n)
        while not self.kv_cache_manager.allocate_slots(request, n, computed, lookahead):
            if not self.running or self.running[-1].priority <= request.priority:
                return False
            self._preempt(self.running[-1], step)
        return True

    def _add_scheduled(self, request: Request, n: int, step: _Step, spec: Sequence[int] = ()) -> None:
        start = request.num_computed_tokens
        end = start + n
        step.scheduled[request.request_id] = self._sent.delta(
            request, start, n, self.kv_cache_manager.block_tables(request),
            sample=end == request.num_tokens and request.sampling_params.max_tokens != 0,
            spec_token_ids=spec,
        )
        # Proposals count as computed until verified (so the request is not
        # scheduled again meanwhile); update_from_output rolls back the rejected.
        request.num_computed_tokens = end + len(spec)
        step.used += n + len(spec)

    def _preempt(self, request: Request, step: _Step) -> None:
        self.kv_cache_manager.free(request)
        self._sent.forget(request.request_id)
        self.running.remove(request)
        self._fork_waiters.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # guesses from before; recompute proposes anew
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)
        step.preempted.add(request.request_id)
        undone = step.scheduled.pop(request.request_id, None)
        if undone is not None:
            step.used -= undone.num_tokens

    def _is_held(self, request: Request) -> bool:
        return request.fork_of is not None and any(
            r is request for r in self._fork_waiters.get(request.fork_of, ())
        )

    # ---- update ---------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results: append sampled tokens, run the stop checks,
        register computed blocks (then release those out of every window), fork
        waiting siblings, free finished requests.

        A request whose own results cannot be applied (the runner reported it
        failed, or its bookkeeping raised) ends with status FINISHED_ERROR and
        an output carrying the error; the other requests are unaffected."""
        self.kv_cache_manager.finish_loads(runner_output.kv_tiers)
        outputs = []
        for scheduled in scheduler_output.scheduled:
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted since it was scheduled
            error = runner_output.failed.get(request.request_id)
            try:
                out = self._update_one(request, scheduled, runner_output) if error is None else None
            except Exception as exc:  # one request's fault must not stop the step
                logger.exception("request %s failed while applying its step results", request.request_id)
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                out = self._fail(request, error)
            if out is not None:
                outputs.append(out)
        return outputs

    def _update_one(
        self, request: Request, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> Optional[EngineCoreOutput]:
        rid = request.request_id
        sampled = runner_output.sampled_token_ids.get(rid, ())
        if scheduled.spec_token_ids:
            self._apply_verification(request, scheduled, len(sampled))
        self.kv_cache_manager.cache_blocks(request)
        prompt_logprobs = take_prompt_logprobs(request, scheduled.start_pos, runner_output.prompt_logprobs.get(rid))
        new_ids, new_logprobs, status = append_sampled(
            request, sampled, runner_output.logprobs.get(rid), self._max_len
        )
        if status is None:
            request.spec_token_ids = runner_output.spec_token_ids.get(rid, [])
        # The chunk's end, not num_computed_tokens: with pipeline stages the
        # request's next chunk may already be scheduled (and counted there).
        end = scheduled.start_pos + scheduled.num_tokens
        if request.sampling_params.max_tokens == 0 and end == request.num_tokens:
            status = RequestStatus.FINISHED_LENGTH  # the prompt is scored
        if end >= request.num_prompt_tokens:
            # Before a finished parent frees the blocks its siblings share.
            self._fork_siblings(request)
        # After the siblings took the table: their first step reads one position further back.
        self.kv_cache_manager.free_unread_blocks(request)
        if status is not None:
            self._finish(request, status)
        if not (new_ids or status is not None or prompt_logprobs):
            return None
        return EngineCoreOutput(
            request_id=rid,
            new_token_ids=new_ids,
            new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=status.finish_reason if status is not None else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            pooled=runner_output.pooled.get(rid),
        )

    def _apply_verification(self, request: Request, scheduled: ScheduledRequest, num_sampled: int) -> None:
        """Roll back the proposals the step rejected: ``num_sampled`` tokens
        came back, the accepted proposals and one token of the target's, so
        all but the last have their K/V in the cache now. Blocks left holding
        no computed token go back to the pool."""
        num_proposed = len(scheduled.spec_token_ids)
        num_accepted = max(0, num_sampled - 1)
        request.num_computed_tokens -= num_proposed - num_accepted
        self.kv_cache_manager.free_unused_blocks(request)
        self.spec_stats.record(num_proposed, num_accepted)

    def _fail(self, request: Request, error: str) -> EngineCoreOutput:
        if not request.is_finished:
            self._finish(request, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=RequestStatus.FINISHED_ERROR.finish_reason,
            error=error,
        )

    def _fork_siblings(self, parent: Request) -> None:
        for child in self._fork_waiters.pop(parent.request_id, ()):
            if len(self.running) >= self.config.max_num_seqs:
                return  # the rest compute their prompt themselves
            self.kv_cache_manager.fork(parent, child)
            self.waiting.remove(child)
            child.status = RequestStatus.RUNNING
            child.first_scheduled_time = time.monotonic()
            # Only the last prompt token runs again: its logits give the
            # child its own first token, its K/V go to a copy of the last block.
            child.num_computed_tokens = child.num_prompt_tokens - 1
            child.num_cached_tokens = child.num_computed_tokens
            self.running.add(child)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        queue = self.running if request.status is RequestStatus.RUNNING else self.waiting
        queue.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        if self._sent.release(rid):
            self._finished_ids.add(rid)
        self._fork_waiters.pop(rid, None)
        siblings = self._fork_waiters.get(request.fork_of) if request.fork_of else None
        if siblings is not None and request in siblings:
            siblings.remove(request)
        del self._requests[rid]
        del self._order[rid]
