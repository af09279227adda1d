"""A request as the scheduler sees it: token ids, progress and status (torch-free)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from octavo.core.structured_output import StructuredOutputGrammar
from octavo.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Work for this one request raised (grammar, detokenizer, bookkeeping):
    # it ends with an error while the rest of the batch goes on.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the
    scheduler advances it when it schedules them. ``all_token_ids`` is the
    prompt followed by the outputs, kept as one list so recompute after
    preemption sees exactly the tokens the first pass saw.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Set for the n-1 siblings of a parallel-sampling group: they share the
    # parent's prompt blocks instead of computing the prompt again.
    fork_of: Optional[str] = None
    # Mixed into every prefix-cache hash: requests with different salts never
    # share cached K/V (tenant isolation; adapters would go here too).
    cache_salt: Optional[str] = None
    # Structured output: this sequence's grammar, compiled by the engine's
    # backend. The step's mask comes from it; the scheduler advances it by
    # every sampled token.
    grammar: Optional[StructuredOutputGrammar] = None
    # An embedding request's pooling type (octavo/pooling.py): it computes its
    # prompt and ends. Every pooling type but last reads every prompt
    # position's hidden state, so those requests take no prefix-cache hits.
    pooling: Optional[str] = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    stop_reason: Optional[int | str] = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    cumulative_logprob: float = 0.0
    first_scheduled_time: Optional[float] = None
    # Prompt positions below this already had their logprobs reported
    # (position 0 has none); kept across preemption so recompute repeats none.
    prompt_logprobs_upto: int = 1
    # Speculative decoding: tokens a proposer guessed to follow, not yet
    # verified; the next step schedules them after the request's last token.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def grammar_terminated(self) -> bool:
        """True once the request's grammar is complete: only EOS may follow."""
        return self.grammar is not None and self.grammar.is_terminated()

    @property
    def is_finished(self) -> bool:
        return self.status.finished
