"""Prometheus metrics, named like vLLM's under the ``octavo:`` prefix.

Three sources, one registry (docs/METRICS.md lists every metric):

- the engine's state, counters and per-step histograms, from its latest
  EngineStats snapshot (``engine_collector.py``);
- per-request latencies and sizes, observed here in the front as each
  request's outputs arrive (the engine-side phases, queue / prefill / decode,
  from the timestamps the engine stamps on the request's metrics);
- the front's own: HTTP requests by route template and status
  (prometheus-fastapi-instrumentator, vLLM's choice), requests refused before
  reaching the engine, requests that failed in it, and the process metrics of
  the front and of the engine process (``process_*`` and ``octavo_engine_process_*``).
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from prometheus_client import (
    CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector,
    generate_latest,
)
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from octavo.outputs import RequestOutput
from octavo.server.engine_collector import EngineSource, EngineStatsCollector

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Whole requests and their phases; the small buckets resolve queue times, which are ms when the engine keeps up.
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0)
_HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Scrapes and health probes would outnumber the API calls.
_HTTP_EXCLUDED = ["^/metrics$", "^/health$"]

# Why a request was refused before the engine saw it (label values of requests_refused).
REFUSED_QUEUE_FULL = "queue_full"  # --max-waiting-requests: 503
REFUSED_ENGINE_DEAD = "engine_dead"  # 503
REFUSED_SHUTTING_DOWN = "shutting_down"  # 503
REFUSED_REQUEST_LIMIT = "request_limit"  # a per-field request limit (--max-n, --max-stop, ...): 400
REFUSED_CONTEXT_LENGTH = "context_length"  # prompt + max_tokens over max_model_len: 400
REFUSED_SHED = "shed"  # a sheddable priority while the engine is near capacity (--shed-*): 503
# Why a request the engine accepted did not complete (label values of request_errors).
ERROR_ENGINE = "engine_error"  # the engine failed this request: 500
ERROR_ENGINE_DEAD = "engine_dead"  # the engine died under it: 503
ERROR_ENGINE_HUNG = "engine_hung"  # a step of the engine hung under it: 503
ERROR_TIMEOUT = "timeout"  # --request-timeout passed: 504
ERROR_REJECTED = "rejected"  # the engine refused input the front let through: 400
REFUSED_REASONS = (REFUSED_QUEUE_FULL, REFUSED_ENGINE_DEAD, REFUSED_SHUTTING_DOWN, REFUSED_REQUEST_LIMIT,
                   REFUSED_CONTEXT_LENGTH, REFUSED_SHED)
ERROR_REASONS = (ERROR_ENGINE, ERROR_ENGINE_DEAD, ERROR_TIMEOUT, ERROR_REJECTED)
# Label values of request_success: the engine's finish reasons, and abort when the client went away.
FINISHED_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the first bound >= ``max_value``."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            bounds.append(float(mantissa * scale))
            if bounds[-1] >= max_value:
                return tuple(bounds)
        scale *= 10


def new_registry() -> CollectorRegistry:
    """A registry holding the front process's metrics (``process_*``, ``python_*``)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)  # CPython only: a no-op elsewhere
    return registry


def instrument_http(app: FastAPI, registry: CollectorRegistry) -> None:
    """``http_requests_total`` (method, handler = route template, exact status)
    and ``http_request_duration_seconds`` (the whole response, a stream to
    its last byte). Add it after every other middleware: outermost, it
    counts their refusals (401, 413) too."""
    (
        Instrumentator(should_group_status_codes=False, excluded_handlers=_HTTP_EXCLUDED, registry=registry)
        .add(http_metrics.requests(registry=registry))
        .add(http_metrics.latency(buckets=_HTTP_BUCKETS, registry=registry))
        .instrument(app)
    )


class ServerMetrics:
    """The server's metrics once its engine runs (``model_name`` labels every one)."""

    def __init__(self, registry: CollectorRegistry, source: EngineSource, max_model_len: int) -> None:
        self.registry = registry
        registry.register(EngineStatsCollector(source))
        # The engine process's memory is most of the server's; absent while no engine runs.
        ProcessCollector(namespace="octavo_engine", pid=source.pid, registry=registry)
        model = source.model_name
        self.model_name = model

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"octavo:{name}", doc, ["model_name"], buckets=buckets, registry=registry).labels(model)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output steps of a request.", _LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Per request: first to last output token, divided by output tokens - 1.",
                              _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last output (or to the end).", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token (engine clock).",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to last token (engine clock).",
                                _REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "First scheduled to last token: prefill + decode (engine clock).", _REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_len = histogram("request_generation_tokens", "Output tokens per request (all sequences).",
                                        tokens)
        self.success = Counter("octavo:request_success", "Finished requests by finish reason (abort: client gone).",
                               ["model_name", "finished_reason"], registry=registry)
        self._refused = Counter("octavo:requests_refused", "Requests refused before reaching the engine, by reason.",
                                ["model_name", "reason"], registry=registry)
        self.errors = Counter("octavo:request_errors", "Requests the engine accepted that failed, by reason.",
                              ["model_name", "reason"], registry=registry)
        # Every known label value exported at 0 from the start: a series that appears only at its first
        # event reads "No data" on a dashboard, and a sum with it is empty, where the truth is 0.
        for counter, values in ((self.success, FINISHED_REASONS), (self._refused, REFUSED_REASONS),
                                (self.errors, ERROR_REASONS)):
            for value in values:
                counter.labels(model, value)

    def refused(self, reason: str) -> None:
        self._refused.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, arrival: float, num_prompt_tokens: int) -> RequestTracker:
        return RequestTracker(self, arrival, num_prompt_tokens)


class RequestTracker:
    """Latency bookkeeping of one engine request, fed with each output."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompt_tokens: int) -> None:
        self._m = metrics
        self._arrival = arrival
        self._num_prompt_tokens = num_prompt_tokens
        self._first: Optional[float] = None
        self._last: Optional[float] = None
        self._num_tokens = 0
        self._finish_reason: Optional[str] = None  # of the first sequence

    def on_output(self, out: RequestOutput, now: float) -> None:
        """``out``: a delta (what is new since the previous output)."""
        for c in out.outputs:
            if c.index == 0 and c.finish_reason is not None:
                self._finish_reason = c.finish_reason
        new = sum(len(c.token_ids) for c in out.outputs)
        if not new:
            return
        self._num_tokens += new
        if self._last is None:
            self._first = now
            self._m.ttft.observe(now - self._arrival)
        else:
            self._m.itl.observe(now - self._last)
        self._last = now

    def on_finish(self, out: Optional[RequestOutput], now: float, error: Optional[str] = None) -> None:
        """``out`` is None when the request ended early: with ``error`` (one of
        the ERROR_* reasons) when it failed, else the client went away (abort)."""
        m = self._m
        if error is not None:
            m.errors.labels(m.model_name, error).inc()
        else:
            reason = self._finish_reason if out is not None else None
            m.success.labels(m.model_name, reason or "abort").inc()
        m.e2e.observe(now - self._arrival)
        m.prompt_len.observe(self._num_prompt_tokens)
        m.generation_len.observe(self._num_tokens)
        if self._first is not None and self._last is not None and self._num_tokens > 1:
            m.tpot.observe((self._last - self._first) / (self._num_tokens - 1))
        times = out.metrics if out is not None else None
        if times is None or times.first_scheduled_time is None:
            return
        # The engine stamps these with time.monotonic() in its own process: the
        # same clock as the front's (CLOCK_MONOTONIC is system-wide on Linux).
        m.queue.observe(max(0.0, times.first_scheduled_time - times.arrival_time))
        if times.first_token_time is not None and times.last_token_time is not None:
            m.prefill.observe(max(0.0, times.first_token_time - times.first_scheduled_time))
            m.decode.observe(max(0.0, times.last_token_time - times.first_token_time))
            m.inference.observe(max(0.0, times.last_token_time - times.first_scheduled_time))
