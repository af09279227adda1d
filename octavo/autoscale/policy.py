"""The autoscaling policy: replicas wanted, from a window of fleet metrics.

Pure and clock-free: ``Autoscaler.decide(samples, current_replicas, now)``
reads only what it is given, and the only state it keeps is what HPA keeps
(past recommendations and scale events, for stabilisation and rate limits)
plus the request-rate history the forecaster fits. The same object therefore
runs under ``octavo autoscale`` on wall-clock time and under the capacity
simulator on simulated time.

One decision:
1. reactive: per signal, HPA's ``ceil(load / target)`` with a tolerance band
   (``reactive.py``); the highest over the configured signals;
2. predictive (optional): the forecast's peak arrival rate over the next
   ``horizon_s`` (the time a new replica takes to become ready), divided by
   the measured per-replica capacity, times ``headroom``: replicas started
   now are ready when that load arrives;
3. combined = max(reactive, predictive), clamped to [min, max];
4. stabilised (up to the lowest recommendation of the up window, down to the
   highest of the down window) and rate-limited;
5. scale to zero after ``idle_before_zero_s`` without any traffic, and from
   zero as soon as a request arrives or waits (these two bypass 4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from octavo.autoscale.forecast import Forecast, RateHistory
from octavo.autoscale.reactive import SIGNALS, RateLimit, Recommendation, Stabiliser, hpa_recommendation
from octavo.autoscale.refit import FitJob, Fitter, InlineFitter
from octavo.autoscale.samples import MetricsSample
from octavo.config import option, section

__all__ = [
    "SIGNALS", "MetricsSample", "ReactiveConfig", "PredictiveConfig", "AutoscalerConfig", "ScaleDecision",
    "Autoscaler",
]


@dataclass
class ReactiveConfig:
    """HPA on one or more signals: ``targets`` maps a signal (``SIGNALS``) to
    its per-replica target; with several, the largest recommendation wins (as
    HPA does with several metrics). Each signal's value is its mean over the
    samples of the last ``metric_window_s``."""

    targets: dict[str, float] = field(default_factory=lambda: {"in_flight": 8.0}, metadata={
        "help": f"per-replica target of each signal to scale on ({', '.join(SIGNALS)}); the largest "
                "recommendation wins", "metavar": "SIGNAL=VALUE"})
    metric_window_s: float = option(30.0, "seconds of samples a signal's value is averaged over")
    tolerance: float = option(0.1, "no change while value/target is within 1 +- this")

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("reactive.targets must name at least one signal")
        for signal, target in self.targets.items():
            if signal not in SIGNALS:
                raise ValueError(f"reactive.targets: signal must be one of {', '.join(SIGNALS)}; got {signal!r}")
            if not (target > 0):
                raise ValueError(f"reactive.targets[{signal}] must be > 0, got {target}")
        if not (self.metric_window_s > 0):
            raise ValueError(f"reactive.metric_window_s must be > 0, got {self.metric_window_s}")
        if not (0 <= self.tolerance < 1):
            raise ValueError(f"reactive.tolerance must be in [0, 1), got {self.tolerance}")


@dataclass
class PredictiveConfig:
    """Forecast-driven replicas: ``capacity_per_replica`` is the arrival rate
    (requests/s) one replica serves within its latency objective (measure it:
    docs/AUTOSCALING.md); ``horizon_s`` the cold start, from a scale-up
    decision to a ready replica."""

    enabled: bool = option(False, "also scale on the forecast request rate (max of the two)")
    capacity_per_replica: Optional[float] = option(None, "requests/s one replica serves within its latency "
                                                         "objective (measured)")
    horizon_s: float = option(600.0, "forecast horizon: a replica's cold start, decision to ready")
    headroom: float = option(1.2, "replicas for forecast * headroom")
    bucket_s: float = option(60.0, "the forecaster's time step (seconds)")
    seasonal_periods_s: tuple[float, ...] = option((86400.0, 604800.0), "seasons the history may show "
                                                   "(seconds); the longest covered twice is used")
    history_s: float = option(15 * 86400.0, "seconds of request-rate history kept")
    refit_interval_s: float = option(300.0, "seconds between forecaster fits")

    def __post_init__(self) -> None:
        self.seasonal_periods_s = tuple(float(p) for p in self.seasonal_periods_s)
        if self.enabled and not (self.capacity_per_replica is not None and self.capacity_per_replica > 0):
            raise ValueError("predictive.capacity_per_replica must be > 0 when predictive.enabled")
        for name in ("horizon_s", "bucket_s", "history_s", "refit_interval_s"):
            if not (getattr(self, name) > 0):
                raise ValueError(f"predictive.{name} must be > 0, got {getattr(self, name)}")
        if not (self.headroom >= 1):
            raise ValueError(f"predictive.headroom must be >= 1, got {self.headroom}")
        if any(not (p > 0) for p in self.seasonal_periods_s):
            raise ValueError(f"predictive.seasonal_periods_s must be > 0, got {self.seasonal_periods_s}")


@dataclass
class AutoscalerConfig:
    """Bounds, stabilisation windows and rate limits (HPA's defaults: up at
    once by max(4 pods, 100%) per 15 s; down to the highest recommendation of
    the last 300 s, by up to 100% per 15 s)."""

    min_replicas: int = option(1, "fewest replicas while there is traffic")
    max_replicas: int = option(4, "most replicas")
    scale_to_zero: bool = option(False, "stop every replica after idle_before_zero_s without traffic; the "
                                        "first request queued at the gateway starts min_replicas again")
    idle_before_zero_s: float = option(300.0, "seconds without any request before scaling to zero")
    scale_up_window_s: float = option(0.0, "scale up to the lowest recommendation of this many seconds")
    scale_down_window_s: float = option(300.0, "scale down to the highest recommendation of this many seconds")
    scale_up_pods: int = option(4, "scale up by at most max(pods, percent) per period")
    scale_up_percent: float = option(100.0, "scale up by at most max(pods, percent) per period")
    scale_up_period_s: float = option(15.0, "the scale-up limit's period (seconds)")
    scale_down_pods: int = option(0, "scale down by at most max(pods, percent) per period")
    scale_down_percent: float = option(100.0, "scale down by at most max(pods, percent) per period")
    scale_down_period_s: float = option(15.0, "the scale-down limit's period (seconds)")
    reactive: ReactiveConfig = section(ReactiveConfig, prefixed=True)
    predictive: PredictiveConfig = section(PredictiveConfig, prefixed=True)

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1 (scale_to_zero allows 0 when idle), got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas must be >= min_replicas ({self.min_replicas}), got {self.max_replicas}")
        for name in ("idle_before_zero_s", "scale_up_window_s", "scale_down_window_s"):
            if not (getattr(self, name) >= 0):
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for side in ("up", "down"):
            for part in ("pods", "percent"):
                if not (getattr(self, f"scale_{side}_{part}") >= 0):
                    raise ValueError(f"scale_{side}_{part} must be >= 0, got {getattr(self, f'scale_{side}_{part}')}")
            if not (getattr(self, f"scale_{side}_period_s") > 0):
                raise ValueError(f"scale_{side}_period_s must be > 0, got {getattr(self, f'scale_{side}_period_s')}")
        if self.scale_up_pods == 0 and self.scale_up_percent == 0:
            raise ValueError("scale_up_pods and scale_up_percent are both 0: the fleet could never grow")


@dataclass(frozen=True)
class ScaleDecision:
    """``replicas`` to run, and why (one line for the log); ``reactive`` and
    ``predictive`` are the two halves' raw recommendations (None: no data)."""

    replicas: int
    reason: str
    reactive: Optional[int] = None
    predictive: Optional[int] = None


class Autoscaler:
    def __init__(self, config: AutoscalerConfig, fitter: Optional[Fitter] = None) -> None:
        self.config = config
        # Inline by default: deterministic, as the simulator needs; the control loop passes a background one.
        self._fitter = fitter or InlineFitter()
        c = config
        self._stabiliser = Stabiliser(
            c.scale_up_window_s, c.scale_down_window_s,
            RateLimit(c.scale_up_pods, c.scale_up_percent, c.scale_up_period_s),
            RateLimit(c.scale_down_pods, c.scale_down_percent, c.scale_down_period_s),
        )
        p = c.predictive
        self._history = RateHistory(p.bucket_s, p.history_s)
        self._last_seen: Optional[float] = None
        self._last_active: Optional[float] = None
        self._forecast: Optional[Forecast] = None
        self._fitted_at = -math.inf

    def decide(self, samples: Sequence[MetricsSample], current_replicas: int, now: float) -> ScaleDecision:
        """Replicas wanted at ``now`` given ``samples`` (oldest first; samples
        after ``now`` are ignored) and the replicas running now."""
        if current_replicas < 0:
            raise ValueError(f"current_replicas must be >= 0, got {current_replicas}")
        self._ingest(samples, now)
        window = _window(samples, now - self.config.reactive.metric_window_s, now)
        if current_replicas == 0:
            return self._from_zero(window, now)
        reactive = self._reactive(window, current_replicas)
        predictive, forecast_note = self._predictive(now)
        parts = [_describe(reactive) if reactive else "reactive: no data"]
        if forecast_note:
            parts.append(forecast_note)
        if self._idle_long_enough(now) and not predictive:
            return self._change(current_replicas, 0, now, parts + [
                f"idle for {self.config.idle_before_zero_s:g}s: scale to zero"], reactive, predictive)
        candidates = [r for r in (_replicas(reactive), predictive) if r is not None]
        raw = max(candidates) if candidates else current_replicas
        bounded = min(max(raw, self.config.min_replicas), self.config.max_replicas)
        if bounded != raw:
            parts.append(f"bounded to [{self.config.min_replicas}, {self.config.max_replicas}]")
        stable = self._stabiliser.stabilise(bounded, current_replicas, now)
        if stable != bounded:
            window_s = self.config.scale_down_window_s if stable > bounded else self.config.scale_up_window_s
            parts.append(f"stabilised to {stable} (window {window_s:g}s)")
        limited, limit_note = self._stabiliser.limit(stable, current_replicas, now)
        if limit_note:
            parts.append(limit_note)
        return self._change(current_replicas, limited, now, parts, reactive, predictive)

    def _ingest(self, samples: Sequence[MetricsSample], now: float) -> None:
        """Samples newer than the last seen, in order, into the history."""
        fresh = []
        for sample in reversed(samples):
            if self._last_seen is not None and sample.time <= self._last_seen:
                break
            if sample.time <= now:
                fresh.append(sample)
        for sample in reversed(fresh):
            self._history.add(sample.time, sample.request_rate)
            if self._last_active is None or not sample.idle:
                self._last_active = sample.time
            self._last_seen = sample.time

    def _idle_long_enough(self, now: float) -> bool:
        return (self.config.scale_to_zero and self._last_active is not None
                and now - self._last_active >= self.config.idle_before_zero_s)

    def _from_zero(self, window: Sequence[MetricsSample], now: float) -> ScaleDecision:
        if not self.config.scale_to_zero:
            return self._change(0, self.config.min_replicas, now, ["no replica running: start the minimum"], None, None)
        pending = max((max(s.waiting, s.request_rate) for s in window), default=0.0)
        if pending > 0:
            return self._change(0, self.config.min_replicas, now, [
                f"scale from zero: {pending:g} requests waiting or arriving per second"], None, None)
        return self._change(0, 0, now, ["scaled to zero: no request waiting or arriving"], None, None)

    def _reactive(self, window: Sequence[MetricsSample], current: int) -> Optional[Recommendation]:
        recs = [
            r for signal, target in self.config.reactive.targets.items()
            if (r := hpa_recommendation(window, signal, target, current, self.config.reactive.tolerance))
        ]
        return max(recs, key=lambda r: r.replicas) if recs else None

    def _predictive(self, now: float) -> tuple[Optional[int], Optional[str]]:
        p = self.config.predictive
        if not p.enabled:
            return None, None
        self._forecast = self._fitter.latest()
        peak = self._forecast.peak(now, now + p.horizon_s) if self._forecast else None
        if peak is None or now - self._fitted_at >= p.refit_interval_s:
            first, values = self._history.complete(now)
            # From the first bucket after the history (earlier than now after a gap in the
            # scrapes) to the end of the horizon of the last decision before the next refit.
            steps = math.ceil((now + p.horizon_s + p.refit_interval_s) / p.bucket_s) - (first + len(values)) + 1
            self._fitter.refit(FitJob(first, values, p.bucket_s, p.seasonal_periods_s, steps))
            self._fitted_at = now
            self._forecast = self._fitter.latest()
            peak = self._forecast.peak(now, now + p.horizon_s) if self._forecast else None
        if peak is None or self._forecast is None:
            return None, "predictive: fitting" if self._fitter.busy else "predictive: history too short"
        # PredictiveConfig refuses enabled without a capacity.
        replicas = math.ceil(peak * p.headroom / float(p.capacity_per_replica) - 1e-9)
        return replicas, (f"predictive {replicas} (peak {peak:.3g} req/s within {p.horizon_s:g}s, "
                          f"{self._forecast.model})")

    def _change(self, current: int, new: int, now: float, parts: list[str],
                reactive: Optional[Recommendation], predictive: Optional[int]) -> ScaleDecision:
        self._stabiliser.record_change(current, new, now)
        head = f"{current} -> {new}" if new != current else f"stay at {current}"
        return ScaleDecision(new, f"{head}: " + "; ".join(parts), _replicas(reactive), predictive)


def _window(samples: Sequence[MetricsSample], since: float, now: float) -> list[MetricsSample]:
    picked = []
    for sample in reversed(samples):
        if sample.time < since:
            break
        if sample.time <= now:
            picked.append(sample)
    picked.reverse()
    return picked


def _replicas(rec: Optional[Recommendation]) -> Optional[int]:
    return rec.replicas if rec else None


def _describe(rec: Recommendation) -> str:
    return f"{rec.signal} {rec.value:.3g}/replica (x{rec.ratio:.2f} of target) -> {rec.replicas}"
