"""Where the policy's ``MetricsSample``s come from.

- ``PrometheusSignals``: instant queries against Prometheus' HTTP API
  (``/api/v1/query``); the PromQL is configurable, the defaults read the
  replicas' ``octavo:`` metrics and, when Prometheus scrapes the gateway too,
  its arrival counters (which also count requests no replica could take).
- ``ScrapeSignals``: the replicas' (and optionally the gateway's) ``/metrics``
  scraped directly, for a fleet without Prometheus. Rates and the TTFT
  quantile come from the difference between two successive scrapes, the way
  ``rate()`` and ``histogram_quantile()`` compute them.

Both return None for a quantity they cannot measure (an empty query result,
no finished request yet) rather than a guess.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from octavo.autoscale.samples import MetricsSample

logger = logging.getLogger(__name__)


_RATE = "(sum(rate(octavo_gateway:requests_total[{w}])) + sum(rate(octavo_gateway:unavailable_total[{w}])))" \
        " or sum(rate(octavo:e2e_request_latency_seconds_count[{w}]))"
_TTFT = "histogram_quantile(0.99, sum by (le) (rate(octavo:time_to_first_token_seconds_bucket[{w}])))"


@dataclass
class PromQueries:
    """One PromQL expression per sample field; each must return one scalar
    (a single-element vector). ``window(...)`` builds the defaults for
    another ``rate()`` range: rate() divides by the whole range, so keep it
    at least a few scrape intervals and expect low rates until Prometheus has
    that much history."""

    replicas: str = "count(octavo:num_requests_running)"
    request_rate: str = _RATE.format(w="1m")
    waiting: str = "sum(octavo:num_requests_waiting)"
    running: str = "sum(octavo:num_requests_running)"
    kv_usage: str = "avg(octavo:kv_cache_usage_perc)"
    ttft_p99: str = _TTFT.format(w="1m")

    @classmethod
    def window(cls, rate_window: str) -> PromQueries:
        return cls(request_rate=_RATE.format(w=rate_window), ttft_p99=_TTFT.format(w=rate_window))


class PrometheusSignals:
    def __init__(self, url: str, queries: Optional[PromQueries] = None, timeout_s: float = 5.0,
                 client: Optional[httpx.Client] = None) -> None:
        self.url = url.rstrip("/")
        self.queries = queries or PromQueries()
        self._client = client or httpx.Client(timeout=timeout_s)

    def query(self, promql: str) -> Optional[float]:
        """One instant query's scalar; None for an empty result or NaN (no data)."""
        r = self._client.get(f"{self.url}/api/v1/query", params={"query": promql})
        r.raise_for_status()
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {promql!r}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":
            value = float(data["result"][1])
        elif data["resultType"] == "vector" and data["result"]:
            if len(data["result"]) > 1:
                raise RuntimeError(f"{promql!r} returned {len(data['result'])} series; aggregate it to one")
            value = float(data["result"][0]["value"][1])
        else:
            return None
        return None if math.isnan(value) else value

    def sample(self, now: float) -> MetricsSample:
        q = self.queries
        values = {name: self.query(getattr(q, name)) for name in
                  ("replicas", "request_rate", "waiting", "running", "kv_usage", "ttft_p99")}
        return MetricsSample(
            time=now,
            replicas=int(values["replicas"] or 0),
            request_rate=max(0.0, values["request_rate"] or 0.0),
            waiting=values["waiting"] or 0.0,
            running=values["running"] or 0.0,
            kv_usage=min(1.0, max(0.0, values["kv_usage"] or 0.0)),
            ttft_p99=values["ttft_p99"],
        )


@dataclass
class _Scrape:
    """The numbers one /metrics page gives the policy."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    finished: float = 0.0  # requests finished, cumulative
    ttft_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count)
    gateway_requests: float = 0.0  # the gateway's arrivals, cumulative


def parse_metrics(text: str) -> _Scrape:
    """The fields of ``_Scrape`` from a replica's or the gateway's page (summed over label sets)."""
    s = _Scrape()
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, sample.value
            if name == "octavo:num_requests_waiting":
                s.waiting += value
            elif name == "octavo:num_requests_running":
                s.running += value
            elif name == "octavo:kv_cache_usage_perc":
                s.kv_usage = max(s.kv_usage, value)
            elif name == "octavo:e2e_request_latency_seconds_count":
                s.finished += value
            elif name == "octavo:time_to_first_token_seconds_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + value
            elif name in ("octavo_gateway:requests_total", "octavo_gateway:unavailable_total"):
                s.gateway_requests += value
    s.ttft_buckets = tuple(sorted(buckets.items()))
    return s


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> Optional[float]:
    """``histogram_quantile``'s estimate from cumulative (bound, count) pairs:
    linear within the bucket the rank falls in; the highest finite bound when
    it falls in +Inf. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


class ScrapeSignals:
    """``replica_urls()`` gives the replicas to scrape now (the actuator's or
    the gateway's list); ``gateway_url``, when set, counts arrivals there."""

    def __init__(self, replica_urls: Callable[[], Sequence[str]], gateway_url: Optional[str] = None,
                 timeout_s: float = 5.0, client: Optional[httpx.Client] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        self.replica_urls = replica_urls
        self.gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self._client = client or httpx.Client(timeout=timeout_s, headers=headers)
        self._previous: dict[str, tuple[float, _Scrape]] = {}

    def _scrape(self, base: str) -> Optional[_Scrape]:
        try:
            r = self._client.get(f"{base.rstrip('/')}/metrics")
            r.raise_for_status()
        except httpx.HTTPError as exc:
            # A replica starting or stopping: it is not counted in this sample.
            logger.debug("scrape of %s failed: %s", base, exc)
            return None
        return parse_metrics(r.text)

    def sample(self, now: float) -> MetricsSample:
        scraped = {url: s for url in self.replica_urls() if (s := self._scrape(url)) is not None}
        finished_rate, ttft_deltas = 0.0, {}
        for url, s in scraped.items():
            before = self._previous.get(url)
            if before is not None and now > before[0]:
                finished_rate += max(0.0, s.finished - before[1].finished) / (now - before[0])
                old = dict(before[1].ttft_buckets)
                for bound, count in s.ttft_buckets:
                    ttft_deltas[bound] = ttft_deltas.get(bound, 0.0) + max(0.0, count - old.get(bound, 0.0))
        request_rate = finished_rate
        if self.gateway_url is not None:
            gateway = self._scrape(self.gateway_url)
            before = self._previous.get(self.gateway_url)
            if gateway is not None:
                if before is not None and now > before[0]:
                    request_rate = max(0.0, gateway.gateway_requests - before[1].gateway_requests) / (now - before[0])
                self._previous[self.gateway_url] = (now, gateway)
        for url, s in scraped.items():
            self._previous[url] = (now, s)
        for gone in set(self._previous) - set(scraped) - {self.gateway_url}:
            del self._previous[gone]
        n = len(scraped)
        return MetricsSample(
            time=now,
            replicas=n,
            request_rate=request_rate,
            waiting=sum(s.waiting for s in scraped.values()),
            running=sum(s.running for s in scraped.values()),
            kv_usage=min(1.0, sum(s.kv_usage for s in scraped.values()) / n) if n else 0.0,
            ttft_p99=bucket_quantile(0.99, sorted(ttft_deltas.items())),
        )
