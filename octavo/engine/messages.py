"""Messages between the HTTP front and the engine process (msgpack via msgspec).

Outputs travel as deltas: each step sends only the tokens, logprobs and text
that are new since the previous message for that request, so the IPC cost of
a request stays linear in its length (cumulative outputs would be quadratic).
The front rebuilds cumulative ``RequestOutput`` objects from them
(``apply_delta``); the engine side computes them (``DeltaTracker``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import msgspec

from octavo.engine.stats import EngineStats
from octavo.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from octavo.sampling_params import SamplingParams


# Front -> engine.
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: Optional[float] = None


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


# Engine -> front.
class EngineReady(msgspec.Struct, tag=True):
    model_name: str
    max_model_len: int
    vocab_size: int
    generation_defaults: dict[str, Any]
    pid: int


class ChoiceDelta(msgspec.Struct):
    index: int
    text_start: int  # keep text[:text_start], then append text
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprobs]]
    cumulative_logprob: float
    finish_reason: Optional[str]
    stop_reason: Optional[Union[int, str]]


class OutputDelta(msgspec.Struct):
    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # the new entries
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[OutputDelta]


class StatsUpdate(msgspec.Struct, tag=True):
    stats: EngineStats


class RequestRejected(msgspec.Struct, tag=True):
    """add_request raised: the front validates first, so this is a safety net."""

    request_id: str
    message: str


class EngineFailed(msgspec.Struct, tag=True):
    """A fatal error: the engine process exits after sending it."""

    message: str


ToEngine = Union[AddRequest, AbortRequests, Shutdown]
FromEngine = Union[EngineReady, StepOutputs, StatsUpdate, RequestRejected, EngineFailed]

encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)


@dataclass
class _Sent:
    text: dict[int, str] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)
    num_logprobs: dict[int, int] = field(default_factory=dict)
    num_prompt_logprobs: int = 0


class DeltaTracker:
    """Engine side: remembers what was already sent for each live request."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def delta(self, out: RequestOutput) -> OutputDelta:
        sent = self._sent.setdefault(out.request_id, _Sent())
        choices = [_choice_delta(c, sent) for c in out.outputs]
        prompt_lps = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) > sent.num_prompt_logprobs:
            prompt_lps = out.prompt_logprobs[sent.num_prompt_logprobs :]
            sent.num_prompt_logprobs = len(out.prompt_logprobs)
        if out.finished:
            del self._sent[out.request_id]
        return OutputDelta(
            request_id=out.request_id,
            choices=choices,
            finished=out.finished,
            prompt_logprobs=prompt_lps,
            num_cached_tokens=out.num_cached_tokens,
            metrics=out.metrics,
            error=out.error,
        )

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sent.pop(rid, None)


def _choice_delta(c: CompletionOutput, sent: _Sent) -> ChoiceDelta:
    prev = sent.text.get(c.index, "")
    start = len(prev) if c.text.startswith(prev) else 0
    n_tok = sent.num_tokens.get(c.index, 0)
    n_lp = sent.num_logprobs.get(c.index, 0)
    sent.text[c.index] = c.text
    sent.num_tokens[c.index] = len(c.token_ids)
    new_lps = None
    if c.logprobs is not None:
        new_lps = c.logprobs[n_lp:]
        sent.num_logprobs[c.index] = len(c.logprobs)
    return ChoiceDelta(
        index=c.index,
        text_start=start,
        text=c.text[start:],
        token_ids=c.token_ids[n_tok:],
        logprobs=new_lps,
        cumulative_logprob=c.cumulative_logprob,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def failed_delta(request_id: str, error: str) -> OutputDelta:
    """The final message of a request the engine could not serve."""
    return OutputDelta(request_id=request_id, choices=[], finished=True, error=error)


def apply_delta(out: RequestOutput, delta: OutputDelta) -> None:
    """Front side: extend the cumulative ``out`` in place with ``delta``."""
    by_index = {c.index: c for c in out.outputs}
    for d in delta.choices:
        c = by_index.get(d.index)
        if c is None:
            c = CompletionOutput(index=d.index, text="", token_ids=[])
            out.outputs.append(c)
            by_index[d.index] = c
        c.text = c.text[: d.text_start] + d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(d.logprobs)
        c.cumulative_logprob = d.cumulative_logprob
        c.finish_reason = d.finish_reason
        c.stop_reason = d.stop_reason
    out.outputs.sort(key=lambda c: c.index)
    if delta.prompt_logprobs is not None:
        if out.prompt_logprobs is None:
            out.prompt_logprobs = []
        out.prompt_logprobs.extend(delta.prompt_logprobs)
    out.finished = delta.finished
    out.num_cached_tokens = delta.num_cached_tokens
    out.metrics = delta.metrics
    out.error = delta.error
