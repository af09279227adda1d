"""Both ends of the step contract's deltas (torch-free).

The scheduler sends a request's data once (``NewRequestData``) and from then
on only what changed: the tokens sampled since, the tail of each block table (one
per KV cache group) from the block the step writes into. So each
side keeps a view of the other: ``SentRequests`` (scheduler side) remembers
how much of each request the workers hold, ``BatchState`` (each worker) holds
the requests themselves. A step therefore costs O(scheduled tokens + new
blocks) to describe, whatever the requests' lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from octavo.core.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from octavo.core.request import Request
from octavo.sampling_params import SamplingParams


class SentRequests:
    """Scheduler side: per request on the workers, how many tokens they hold."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._held: dict[str, int] = {}
        # Sent at least once and not ended: the workers keep state for these,
        # even while preempted (a preempted request keeps its generator there).
        self._on_workers: set[str] = set()

    def delta(
        self, request: Request, start: int, num_tokens: int, block_tables: Sequence[list[int]], sample: bool,
        spec_token_ids: Sequence[int] = (),
    ) -> ScheduledRequest:
        """The step entry computing ``num_tokens`` of the request's tokens from
        ``start``, then the proposals ``spec_token_ids``, with the request's
        current ``block_tables`` (one per KV cache group); records that the workers now hold the
        request's tokens (never the proposals: they are not the request's)."""
        rid = request.request_id
        tokens = self._held.get(rid)
        new = None
        blocks_from = start // self.block_size
        if tokens is None:
            new = NewRequestData(
                rid, request.prompt_token_ids, list(request.output_token_ids),
                request.sampling_params, request.eos_token_id,
            )
            tokens, blocks_from = request.num_tokens, 0
            self._on_workers.add(rid)
        end = start + num_tokens
        new_tokens = request.all_token_ids[tokens:end] if end > tokens else []
        self._held[rid] = max(tokens, end)
        return ScheduledRequest(
            rid, start, num_tokens + len(spec_token_ids), new_tokens, blocks_from,
            [table[blocks_from:] for table in block_tables], sample, new, list(spec_token_ids),
        )

    def forget(self, request_id: str) -> None:
        """The workers drop the request's tokens (preempted): resend it whole."""
        self._held.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """The request ended. True when the workers hold state for it, which
        the next step must tell them to drop; False when it never reached them."""
        self._held.pop(request_id, None)
        if request_id not in self._on_workers:
            return False
        self._on_workers.remove(request_id)
        return True


@dataclass(eq=False)
class CachedRequestState:
    """Worker side: one request as the sampler and the input builder read it
    (the attribute names of ``Request`` they use)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    all_token_ids: list[int] = field(init=False)
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV cache group
    grammar_terminated: bool = False  # from the scheduler, for the min_tokens exemption
    # With proposals: the first proposal position at which the grammar is complete.
    grammar_terminated_at: Optional[int] = None

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def block_ids(self) -> list[int]:
        """The first group's table: a draft model's cache is indexed by it (every group keeps whole
        tables when a draft model runs)."""
        return self.block_tables[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def extend(self, token_ids: list[int]) -> None:
        """Tokens past the prompt are outputs (the scheduler sends the prompt whole)."""
        self.all_token_ids.extend(token_ids)
        self.output_token_ids.extend(token_ids)


@dataclass
class ScheduledRow:
    """One request's share of the step on the worker: positions
    ``start_pos .. start_pos + num_tokens - 1`` of ``request``."""

    request: CachedRequestState | Request
    start_pos: int
    num_tokens: int
    block_tables: list[list[int]]  # per KV cache group, the request's whole table (the worker's lists)
    sample: bool
    # Proposals to verify: the last len(spec_token_ids) of the num_tokens positions.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        return self.block_tables[0]

    @property
    def token_ids(self) -> list[int]:
        num_own = self.num_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[self.start_pos : self.start_pos + num_own] + self.spec_token_ids


class BatchState:
    """Worker side: the requests this worker holds, updated by each step."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        # Of those, the random ones with a seed of their own: while there are none, a step need not look
        # for them row by row (a speculating runner proposes for them whatever its governor chose).
        self.seeded_random = 0

    def apply(self, step: SchedulerOutput) -> list[ScheduledRow]:
        """Drop the requests that left, add the new ones, extend the others;
        the step's rows in scheduling order."""
        for rid in step.finished_request_ids:
            self._drop(rid)
        rows = []
        for s in step.scheduled:
            if s.new is not None:
                n = s.new
                state = CachedRequestState(
                    n.request_id, n.prompt_token_ids, list(n.output_token_ids), n.sampling_params, n.eos_token_id
                )
                self._drop(s.request_id)
                self.requests[s.request_id] = state
                self.seeded_random += seeded_random(n.sampling_params)
            else:
                state = self.requests[s.request_id]
            if s.new_token_ids:
                state.extend(s.new_token_ids)
            if not state.block_tables:
                state.block_tables = [[] for _ in s.block_ids]
            for table, tail in zip(state.block_tables, s.block_ids):
                del table[s.blocks_from :]
                table.extend(tail)
            rows.append(ScheduledRow(state, s.start_pos, s.num_tokens, state.block_tables, s.sample,
                                     s.spec_token_ids))
        if step.grammar is not None:
            for rid in step.grammar.request_ids:
                self.requests[rid].grammar_terminated = rid in step.grammar.terminated
                self.requests[rid].grammar_terminated_at = step.grammar.terminated_at.get(rid)
        return rows

    def _drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.seeded_random -= seeded_random(state.sampling_params)


def seeded_random(params: SamplingParams) -> bool:
    """A request that draws at random from a seed of its own: its output must not depend on how the engine
    shapes its steps."""
    return params.seed is not None and not params.greedy
