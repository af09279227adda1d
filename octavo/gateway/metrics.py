"""The gateway's own Prometheus metrics (``octavo_gateway:`` prefix).

Added latency is the gateway's share of a request: its whole time minus the
time spent waiting on the replica (until the full body, or until the first
chunk of a stream), so routing, validation, cache and rate-limit costs show
up there and the model's time does not.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import (
    CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector, generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from octavo.gateway.replicas import ReplicaSet

_ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _ReplicaCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "octavo_gateway:breaker_state", "Circuit breaker per replica: 0 closed, 1 open, 2 half-open.",
            labels=["replica"],
        )
        in_flight = GaugeMetricFamily("octavo_gateway:replica_in_flight", "Requests open on the replica.",
                                      labels=["replica"])
        load = GaugeMetricFamily("octavo_gateway:replica_load", "Running + waiting, as routing sees it.",
                                 labels=["replica"])
        for r in self._replicas:
            state.add_metric([r.url], float(r.breaker.state))
            in_flight.add_metric([r.url], float(r.in_flight))
            load.add_metric([r.url], float(r.load))
        yield state
        yield in_flight
        yield load


class GatewayMetrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaCollector(replicas))
        r = self.registry
        ProcessCollector(registry=r)  # process_*, python_*: as on the replicas
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter("octavo_gateway:requests", "Requests sent to a replica, by status code.",
                                ["replica", "code"], registry=r)
        self.errors = Counter("octavo_gateway:replica_errors", "Failed attempts (connection, timeout, 5xx).",
                              ["replica"], registry=r)
        self.routing = Counter("octavo_gateway:routing_decisions", "Routing decisions by reason.", ["reason"],
                               registry=r)
        self.cache = Counter("octavo_gateway:cache_lookups", "Response cache lookups by result.", ["result"],
                             registry=r)
        self.rate_limited = Counter("octavo_gateway:rate_limited", "Requests refused by a rate limit.", ["limit"],
                                    registry=r)
        self.unavailable = Counter("octavo_gateway:unavailable", "Requests answered 503: every replica failed.",
                                   registry=r)
        # Known label values at 0 from the start: a series born at its first event reads "No data".
        for result in ("hit", "miss"):
            self.cache.labels(result)
        for limit in ("requests", "tokens"):
            self.rate_limited.labels(limit)
        self.added_latency = Histogram("octavo_gateway:added_latency_seconds",
                                       "Gateway time per request, upstream wait excluded.",
                                       buckets=_ADDED_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
