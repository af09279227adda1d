"""What the engine returns to its callers for each request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position, from the model's raw log-softmax."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # best first


@dataclass
class CompletionOutput:
    """One of the n sequences of a request; text and token ids are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float = 0.0
    logprobs: Optional[list[TokenLogprobs]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Optional[int | str] = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # None at position 0
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None
