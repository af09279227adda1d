"""Messages between the HTTP front and the engine process (msgpack via msgspec).

Outputs travel as deltas: the front asks the engine for
``RequestOutputKind.DELTA`` outputs, so each step sends only the tokens,
logprobs and text that are new for that request, and the IPC cost of a
request stays linear in its length (cumulative outputs would be quadratic).
The front folds them together with ``octavo.outputs.OutputAccumulator``.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from octavo.engine.stats import EngineStats
from octavo.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from octavo.pooling import PoolerConfig, PoolingParams
from octavo.sampling_params import SamplingParams


# Front -> engine.
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: Optional[SamplingParams]  # None for an embedding request
    priority: int = 0
    arrival_time: Optional[float] = None
    pooling: Optional[PoolingParams] = None  # an embedding request's parameters


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
    model_aliases: list[str] = []  # further names clients may send (--served-model-name a b)
    max_logprobs: int = 20
    pooler: Optional[PoolerConfig] = None  # set when the model serves embeddings


class OutputDelta(msgspec.Struct):
    """A delta RequestOutput less the prompt (the front has it already)."""

    request_id: str
    outputs: list[CompletionOutput]  # the sequences that progressed: their new part
    finished: bool
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # the new entries
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None
    embedding: Optional[list[float]] = None


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


def to_message(out: RequestOutput) -> OutputDelta:
    """Engine side: a delta output (RequestOutputKind.DELTA) as sent."""
    return OutputDelta(
        request_id=out.request_id,
        outputs=out.outputs,
        finished=out.finished,
        prompt_logprobs=out.prompt_logprobs,
        num_cached_tokens=out.num_cached_tokens,
        metrics=out.metrics,
        error=out.error,
        embedding=out.embedding,
    )


def from_message(delta: OutputDelta) -> RequestOutput:
    """Front side: the delta as a RequestOutput, for ``OutputAccumulator.add``
    (which supplies the prompt)."""
    return RequestOutput(
        request_id=delta.request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=delta.outputs,
        finished=delta.finished,
        prompt_logprobs=delta.prompt_logprobs,
        num_cached_tokens=delta.num_cached_tokens,
        metrics=delta.metrics,
        error=delta.error,
        embedding=delta.embedding,
    )


def failed_delta(request_id: str, error: str) -> OutputDelta:
    """The final message of a request the engine could not serve."""
    return OutputDelta(request_id=request_id, outputs=[], finished=True, error=error)
