"""The reactive half of the policy: Kubernetes' HPA arithmetic, written for a
metrics window and an explicit clock.

HPA's formula is ``desired = ceil(current * value / target)`` where ``value``
is the per-replica average of a signal measured on ``current`` replicas. Here
each sample carries the replica count it was measured on, so a sample's
*demand* is ``value * sample.replicas`` (in "replicas' worth of target") and
``desired = ceil(mean(demand) / target)``: a window that straddles a scale
event still measures the same load, where ``current * value`` would mix the
new count with values measured on the old one.

Stabilisation and rate limits follow HPA's ``behavior`` semantics: every raw
recommendation is remembered; scaling up goes to the *lowest* recommendation
of the up window, scaling down to the *highest* of the down window (so one
quiet sample cannot remove replicas a busy one asked for five minutes ago),
and a change is capped by pods/percent per period, measured from the replica
count at the start of the period.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from octavo.autoscale.samples import MetricsSample

# The signals the reactive policy scales on. Per replica: waiting requests,
# waiting + running requests, KV usage (0..1), p99 TTFT (seconds), arrivals/s.
SIGNALS = ("waiting", "in_flight", "kv_usage", "ttft_p99", "request_rate")


def demand(sample: MetricsSample, signal: str) -> Optional[float]:
    """One sample's load on ``signal`` in replicas' worth of the per-replica
    value (None where the sample has no value: no replicas, or no TTFT yet)."""
    if sample.replicas <= 0:
        return None
    if signal == "waiting":
        return float(sample.waiting)
    if signal == "in_flight":
        return float(sample.waiting + sample.running)
    if signal == "request_rate":
        return float(sample.request_rate)
    if signal == "kv_usage":
        return float(sample.kv_usage) * sample.replicas
    if signal == "ttft_p99":
        return None if sample.ttft_p99 is None else float(sample.ttft_p99) * sample.replicas
    raise ValueError(f"signal must be one of {', '.join(SIGNALS)}; got {signal!r}")



@dataclass(frozen=True)
class Recommendation:
    replicas: int
    signal: str
    value: float  # the window's mean per-replica value on the current replicas' basis
    ratio: float  # mean demand / (target * current)


def hpa_recommendation(
    samples: Sequence[MetricsSample], signal: str, target: float, current: int, tolerance: float
) -> Optional[Recommendation]:
    """HPA's formula on one signal over ``samples`` (already cut to the metric
    window); inside the tolerance band the answer is ``current``."""
    values = [d for d in (demand(s, signal) for s in samples) if d is not None]
    if not values or current <= 0:
        return None
    load = sum(values) / len(values)
    ratio = load / (target * current)
    replicas = current if abs(ratio - 1.0) <= tolerance else math.ceil(load / target - 1e-9)
    return Recommendation(replicas, signal, load / current, ratio)


@dataclass(frozen=True)
class RateLimit:
    """At most ``max(pods, percent% of the period's starting count)``
    replicas of change per ``period_s`` (HPA's selectPolicy: Max)."""

    pods: int
    percent: float
    period_s: float

    def __post_init__(self) -> None:
        if self.pods < 0 or self.percent < 0 or self.period_s <= 0:
            raise ValueError(f"rate limit needs pods >= 0, percent >= 0, period_s > 0; got {self}")


class Stabiliser:
    """Recommendation history and scale events, kept between decisions."""

    def __init__(self, up_window_s: float, down_window_s: float, up: RateLimit, down: RateLimit) -> None:
        self.up_window_s = up_window_s
        self.down_window_s = down_window_s
        self.up = up
        self.down = down
        self._recommendations: deque[tuple[float, int]] = deque()
        self._events: deque[tuple[float, int]] = deque()  # (time, replica change)

    def stabilise(self, raw: int, current: int, now: float) -> int:
        """HPA's window rule: up to the lowest recent recommendation, down to the highest."""
        horizon = max(self.up_window_s, self.down_window_s)
        while self._recommendations and self._recommendations[0][0] < now - horizon:
            self._recommendations.popleft()
        up_to, down_to = raw, raw
        for t, rec in self._recommendations:
            if t >= now - self.up_window_s:
                up_to = min(up_to, rec)
            if t >= now - self.down_window_s:
                down_to = max(down_to, rec)
        self._recommendations.append((now, raw))
        result = current
        if result < up_to:
            result = up_to
        if result > down_to:
            result = down_to
        return result

    def limit(self, desired: int, current: int, now: float) -> tuple[int, Optional[str]]:
        """``desired`` capped by the rate limits; the second item says which limit bit."""
        if desired > current:
            start = current - self._change_since(now - self.up.period_s)
            ceiling = max(start + self.up.pods, math.ceil(start * (1 + self.up.percent / 100)))
            if desired > ceiling:
                return max(ceiling, current), f"up limit {self.up.pods} pods/{self.up.percent:g}% per {self.up.period_s:g}s"
        elif desired < current:
            start = current - self._change_since(now - self.down.period_s)
            floor = min(start - self.down.pods, math.floor(start * (1 - self.down.percent / 100)))
            if desired < floor:
                return min(floor, current), (
                    f"down limit {self.down.pods} pods/{self.down.percent:g}% per {self.down.period_s:g}s"
                )
        return desired, None

    def record_change(self, current: int, new: int, now: float) -> None:
        if new != current:
            self._events.append((now, new - current))
        keep = max(self.up.period_s, self.down.period_s)
        while self._events and self._events[0][0] < now - keep:
            self._events.popleft()

    def _change_since(self, since: float) -> int:
        return sum(change for t, change in self._events if t > since)
