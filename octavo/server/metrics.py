"""Prometheus metrics, named like vLLM's under the ``octavo:`` prefix.

Engine-side numbers (queue sizes, KV blocks, token and prefix-cache counters)
come from the latest EngineStats snapshot the engine process pushed, exported
by a collector at scrape time; the engine's counters are cumulative already, so
they are exposed as counters without re-counting here. Latencies and finish
reasons are observed in the front, per request.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from octavo.engine.stats import EngineStats
from octavo.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)

_GAUGES = (
    ("num_requests_running", "Requests in the engine's running batch.", lambda s: s.num_running),
    ("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", lambda s: s.kv_cache_usage),
    ("kv_free_blocks", "Free KV cache blocks (cached-but-unused blocks count as free).", lambda s: s.num_free_blocks),
    ("kv_total_blocks", "KV cache blocks in the pool.", lambda s: s.num_total_blocks),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
    ("num_preemptions", "Requests preempted (recomputed later).", lambda s: s.num_preemptions),
    ("prompt_tokens", "Prompt tokens processed.", lambda s: s.prompt_tokens),
    ("generation_tokens", "Tokens generated.", lambda s: s.generation_tokens),
    ("spec_decode_num_drafts", "Speculative verifications (request-steps that carried proposals).",
     lambda s: s.spec_num_drafts),
    ("spec_decode_num_draft_tokens", "Speculative proposals verified.", lambda s: s.spec_num_draft_tokens),
    ("spec_decode_num_accepted_tokens", "Speculative proposals accepted.", lambda s: s.spec_num_accepted_tokens),
)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc, get in _GAUGES:
            family = GaugeMetricFamily(f"octavo:{name}", doc, labels=["model_name"])
            family.add_metric([self._model_name], float(get(stats)))
            yield family
        for name, doc, get in _COUNTERS:
            family = CounterMetricFamily(f"octavo:{name}", doc, labels=["model_name"])
            family.add_metric([self._model_name], float(get(stats)))
            yield family
        family = CounterMetricFamily(
            "octavo:spec_decode_num_accepted_tokens_per_pos",
            "Speculative proposals accepted, by position in the proposal (0 = first).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(stats.spec_accepted_per_position):
            family.add_metric([self._model_name, str(position)], float(count))
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, stats))
        label = ["model_name"]
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"octavo:{name}", doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output steps of a request.", _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.success = Counter(
            "octavo:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, arrival: float) -> RequestTracker:
        return RequestTracker(self, arrival)


class RequestTracker:
    """Latency bookkeeping of one engine request, fed with each output."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._m = metrics
        self._arrival = arrival
        self._last: Optional[float] = None
        self._finish_reason: Optional[str] = None  # of the first sequence

    def on_output(self, out: RequestOutput, now: float) -> None:
        """``out``: a delta (what is new since the previous output)."""
        for c in out.outputs:
            if c.index == 0 and c.finish_reason is not None:
                self._finish_reason = c.finish_reason
        if not any(c.token_ids for c in out.outputs):
            return
        if self._last is None:
            self._m.ttft.observe(now - self._arrival)
        else:
            self._m.itl.observe(now - self._last)
        self._last = now

    def on_finish(self, out: Optional[RequestOutput], now: float) -> None:
        """``out`` is None when the request ended early (client gone, error): it counts as aborted."""
        reason = self._finish_reason if out is not None else None
        self._m.success.labels(self._m.model_name, reason or "abort").inc()
        self._m.e2e.observe(now - self._arrival)
        metrics = out.metrics if out is not None else None
        if metrics is not None and metrics.first_scheduled_time is not None:
            self._m.queue.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
