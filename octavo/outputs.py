"""What the engine returns to its callers for each request.

How much of a request each output holds is its ``SamplingParams.output_kind``:
everything so far (CUMULATIVE), what is new since the previous output of the
request (DELTA: what streams and the engine process send, so that a long
generation costs linear time), or one output at the end (FINAL_ONLY).
``OutputAccumulator`` folds deltas back into one output where a caller
needs the whole."""
from __future__ import annotations

import dataclasses
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
    """One of the n sequences of a request: its text, token ids and logprobs
    so far, or with RequestOutputKind.DELTA those new since the previous output."""

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
    # An embedding request's vector (octavo/pooling.py), in its final output;
    # its one CompletionOutput then holds no tokens.
    embedding: Optional[list[float]] = None


@dataclass
class _PendingChoice:
    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprobs]] = None
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None

    def add(self, c: CompletionOutput) -> None:
        self.text_parts.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(c.logprobs)
        self.cumulative_logprob = c.cumulative_logprob
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason

    def build(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text="".join(self.text_parts),
            token_ids=self.token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class OutputAccumulator:
    """Folds the delta outputs of one request (RequestOutputKind.DELTA) together.

    ``add`` appends a delta's new tokens, logprobs and text; ``take`` returns
    all that was added since the previous ``take`` as one delta and starts
    over. A reader that falls behind thus gets its updates merged into one,
    and one that takes once at the end gets the whole output. Each token is
    appended once and each text piece joined once: linear in the output."""

    def __init__(self, prompt_token_ids: list[int], prompt: Optional[str] = None) -> None:
        # The prompt fields come from here: deltas need not carry them.
        self._base = RequestOutput("", prompt, prompt_token_ids, [], finished=False)
        self._choices: dict[int, _PendingChoice] = {}
        self._prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None

    @property
    def finished(self) -> bool:
        return self._base.finished

    def add(self, delta: RequestOutput) -> None:
        for c in delta.outputs:
            pending = self._choices.get(c.index)
            if pending is None:
                pending = self._choices[c.index] = _PendingChoice(c.index)
            pending.add(c)
        if delta.prompt_logprobs is not None:
            if self._prompt_logprobs is None:
                self._prompt_logprobs = []
            self._prompt_logprobs.extend(delta.prompt_logprobs)
        base = self._base
        base.request_id = delta.request_id
        base.finished = delta.finished
        base.num_cached_tokens = delta.num_cached_tokens
        base.metrics = delta.metrics
        base.error = delta.error
        if delta.embedding is not None:
            base.embedding = delta.embedding

    def take(self) -> RequestOutput:
        outputs = [self._choices[i].build() for i in sorted(self._choices)]
        out = dataclasses.replace(self._base, outputs=outputs, prompt_logprobs=self._prompt_logprobs)
        self._choices, self._prompt_logprobs = {}, None
        return out
