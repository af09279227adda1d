"""The data that crosses the scheduler / model-runner boundary (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from octavo.core.request import Request


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position, from the model's raw log-softmax."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # best first


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions
    ``start_pos .. start_pos + len(token_ids) - 1`` and, when ``sample`` is set,
    sample the next token from the last position's logits."""

    request: Request
    start_pos: int
    token_ids: list[int]
    block_ids: list[int]  # the request's whole block table, in order
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Copy-on-write: copy K/V of block src into block dst before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests that left since the last step (finished, aborted, preempted);
    # the runner drops any per-request state it keeps for them.
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    # Only requests that sampled this step appear; a partial prefill chunk does not.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per scheduled prompt chunk: logprobs of each prompt token given its prefix
    # (the first prompt token has none, so it is absent from the list). For a
    # chunk starting at start_pos, entry i is for prompt position
    # start_pos + 1 + i: the logits of a position score the token after it.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests whose own sampling-side work raised (grammar mask or advance,
    # penalties, logprobs): request id -> message. They sampled nothing; the
    # scheduler ends them with an error, the rest of the step stands.
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What the scheduler reports for one request after a step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[TokenLogprobs]] = None
    prompt_logprobs: Optional[list[TokenLogprobs]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[int | str] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None  # set with finish_reason "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about the loaded model (from the driver rank)."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    # generation_config.json's sampling defaults, fields left unset omitted.
    generation_defaults: dict[str, Any]
