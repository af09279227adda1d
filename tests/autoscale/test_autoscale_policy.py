"""The policy on synthetic traces in simulated time: a fleet whose replica
count follows the autoscaler's decisions, scraped every 5 s, decided every 15 s."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Optional

import pytest

from octavo.autoscale.policy import (
    Autoscaler, AutoscalerConfig, MetricsSample, PredictiveConfig, ReactiveConfig, ScaleDecision,
)

SCRAPE_S = 5.0
DECIDE_S = 15.0


@dataclass
class Run:
    times: list[float]
    replicas: list[int]  # replicas decided at each decision time
    decisions: list[ScaleDecision]

    def at(self, t: float) -> int:
        """Replicas decided at the last decision at or before ``t``."""
        i = max(i for i, tt in enumerate(self.times) if tt <= t)
        return self.replicas[i]

    def changes(self) -> list[float]:
        return [self.times[i] for i in range(1, len(self.times)) if self.replicas[i] != self.replicas[i - 1]]


def simulate(config: AutoscalerConfig, rate: Callable[[float], float], duration_s: float, *,
             start_replicas: int = 1, noise: Optional[random.Random] = None, start: float = 0.0,
             scaler: Optional[Autoscaler] = None) -> Run:
    """Samples of the arrival rate (Poisson counts per scrape when ``noise``)
    on the current replicas; decisions applied at once."""
    scaler = scaler or Autoscaler(config)
    samples: list[MetricsSample] = []
    replicas = start_replicas
    run = Run([], [], [])
    t = start
    next_decision = start
    while t < start + duration_s:
        r = rate(t)
        if noise is not None:
            r = _poisson(noise, r * SCRAPE_S) / SCRAPE_S
        samples.append(MetricsSample(time=t, replicas=replicas, request_rate=r))
        if t >= next_decision:
            decision = scaler.decide(samples[-200:], replicas, t)
            replicas = decision.replicas
            run.times.append(t)
            run.replicas.append(replicas)
            run.decisions.append(decision)
            next_decision += DECIDE_S
        t += SCRAPE_S
    return run


def _poisson(rng: random.Random, mean: float) -> int:
    # Normal approximation is enough at these means (>= 50 arrivals per scrape).
    return max(0, round(rng.gauss(mean, math.sqrt(mean))))


def rate_config(**kw) -> AutoscalerConfig:
    """Target 10 requests/s per replica, short windows for short traces."""
    kw.setdefault("max_replicas", 10)
    kw.setdefault("scale_down_window_s", 120.0)
    return AutoscalerConfig(reactive=ReactiveConfig(targets={"request_rate": 10.0}), **kw)


def test_step_up_at_once_down_after_the_stabilisation_window():
    config = rate_config()
    run = simulate(config, lambda t: 50.0 if 300 <= t < 900 else 10.0, 1500)
    assert run.at(299) == 1
    # Up window 0, so the fleet is sized as soon as the 30 s metric window holds only the new load.
    assert run.at(300 + 30) == 5
    assert "request_rate" in run.decisions[run.times.index(330)].reason
    # Down: the highest recommendation of the last 120 s (5, made at 900 s when the window still
    # held the old load) holds until 120 s after it; then the fleet follows the falling recommendations.
    assert all(run.at(t) == 5 for t in range(330, 900 + 120 + 1, 15))
    assert run.at(900 + 120 + 30) == 1
    ups = [t for t in run.changes() if t < 900]
    downs = [t for t in run.changes() if t >= 900]
    assert len(ups) <= 3 and len(downs) <= 2 and min(downs) > 900 + 120


def test_ramp_tracks_the_load_and_never_overshoots():
    config = rate_config(max_replicas=8)
    ramp = lambda t: min(5.0 + t / 15.0, 100.0)  # noqa: E731 - 5 -> 100 req/s over ~24 min
    run = simulate(config, ramp, 1800)
    for t, n in zip(run.times, run.replicas):
        needed = math.ceil(ramp(t) / 10.0)
        assert n <= 8
        assert n >= min(needed, 8) - 1, f"at {t}s: {n} replicas for {ramp(t):.0f} req/s"
        assert n <= max(needed, 1) + 1
    assert run.replicas == sorted(run.replicas), "a rising load never scales down"
    assert run.replicas[-1] == 8


def test_sine_follows_the_load_with_the_down_window_as_lag():
    config = rate_config(scale_down_window_s=60.0)
    period = 1800.0
    sine = lambda t: 45.0 + 35.0 * math.sin(2 * math.pi * t / period)  # noqa: E731 - 10..80 req/s
    run = simulate(config, sine, 2 * period)
    peak_t, trough_t = period / 4 + period, 3 * period / 4
    assert run.at(peak_t) == 8
    assert run.at(trough_t + 75) <= 2
    for t, n in zip(run.times, run.replicas):
        recent = [sine(u) for u in range(int(t) - 30, int(t) + 1)]
        # The HPA guarantee: capacity within the 10% tolerance of the 30 s metric window's load...
        assert n * 10.0 * 1.1 >= min(recent) - 1e-6, f"at {t}s: {n} replicas for {sine(t):.1f} req/s"
        # ...and no more than the highest load of the 60 s down window (+ the metric window) asked for.
        held = [sine(u) for u in range(int(t) - 90, int(t) + 1)]
        assert n <= math.ceil(max(held) / (10.0 * 0.9)), f"at {t}s: {n} replicas for {sine(t):.1f} req/s"
    # One full cycle: up and down once each way, one replica at a time or in a few steps.
    assert 4 <= len(run.changes()) <= 30


@pytest.mark.parametrize("mean_rate", [30.0, 35.0, 38.0, 42.0])
def test_no_flapping_on_noisy_steady_load(mean_rate):
    config = rate_config(scale_down_window_s=300.0)
    run = simulate(config, lambda t: mean_rate, 2 * 3600, start_replicas=math.ceil(mean_rate / 10),
                   noise=random.Random(int(mean_rate)))
    changes = run.changes()
    for t0 in range(0, 2 * 3600, 60):
        in_ten = [t for t in changes if t0 <= t < t0 + 600]
        assert len(in_ten) <= 2, f"{len(in_ten)} changes in 10 min from {t0}s at {mean_rate} req/s: {changes}"
    # And the fleet is sized for the load, not pinned anywhere by the damping.
    assert all(n * 10.0 >= mean_rate * 0.85 for n in run.replicas)
    assert all(n <= math.ceil(mean_rate * 1.15 / 10.0) + 1 for n in run.replicas)


def test_bounds():
    config = rate_config(min_replicas=2, max_replicas=5)
    assert simulate(config, lambda t: 1000.0, 300).replicas[-1] == 5
    assert max(simulate(config, lambda t: 1000.0, 300).replicas) == 5
    assert simulate(config, lambda t: 0.0, 600, start_replicas=4).replicas[-1] == 2
    assert min(simulate(config, lambda t: 0.0, 600, start_replicas=4).replicas) == 2


def test_scale_up_window_ignores_a_short_spike():
    config = rate_config(scale_up_window_s=60.0)
    spike = simulate(config, lambda t: 80.0 if 300 <= t < 330 else 10.0, 900)
    assert max(spike.replicas) == 1
    lasting = simulate(config, lambda t: 80.0 if t >= 300 else 10.0, 900)
    assert lasting.at(300 + 45) == 1 and lasting.at(300 + 75) == 5  # 1 + 4 pods: the rate limit


def test_rate_limit_one_pod_per_minute():
    config = rate_config(scale_up_pods=1, scale_up_percent=0.0, scale_up_period_s=60.0)
    run = simulate(config, lambda t: 100.0, 600)
    changes = run.changes()
    assert all(b - a >= 60 for a, b in zip(changes, changes[1:]))
    assert run.replicas[-1] == 10
    assert "up limit" in run.decisions[1].reason


def test_tolerance_band_keeps_the_count():
    scaler = Autoscaler(rate_config())
    # 4 replicas at 43 req/s: 1.075x the target, inside the 0.1 band.
    samples = [MetricsSample(time=t, replicas=4, request_rate=43.0) for t in range(0, 30, 5)]
    assert scaler.decide(samples, 4, 30).replicas == 4
    samples = [MetricsSample(time=t, replicas=4, request_rate=46.0) for t in range(30, 60, 5)]
    assert scaler.decide(samples, 4, 60).replicas == 5


def test_several_signals_take_the_largest_recommendation():
    config = AutoscalerConfig(max_replicas=10, reactive=ReactiveConfig(
        targets={"waiting": 2.0, "kv_usage": 0.5, "ttft_p99": 1.0}))
    scaler = Autoscaler(config)
    samples = [MetricsSample(time=t, replicas=2, waiting=2.0, kv_usage=0.9, ttft_p99=None) for t in range(0, 30, 5)]
    decision = scaler.decide(samples, 2, 30)
    assert decision.replicas == 4  # kv: 0.9 * 2 / 0.5 = 3.6 -> 4; waiting: 1 per replica -> 1; no TTFT
    assert "kv_usage" in decision.reason


def test_scale_to_zero_after_idle_and_back_on_the_first_request():
    config = rate_config(scale_to_zero=True, idle_before_zero_s=120.0, scale_down_window_s=30.0)
    scaler = Autoscaler(config)
    idle = simulate(config, lambda t: 0.0, 300, start_replicas=1, scaler=scaler)
    assert idle.at(100) == 1
    assert idle.at(135) == 0
    assert "idle" in idle.decisions[idle.replicas.index(0)].reason
    # At zero the gateway's queue is the only signal: one waiting request starts the minimum.
    quiet = [MetricsSample(time=300.0, replicas=0)]
    assert scaler.decide(quiet, 0, 300.0).replicas == 0
    waiting = [MetricsSample(time=315.0, replicas=0, waiting=1)]
    decision = scaler.decide(waiting, 0, 315.0)
    assert decision.replicas == 1 and "scale from zero" in decision.reason
    # Without scale_to_zero, never zero.
    assert min(simulate(rate_config(), lambda t: 0.0, 600).replicas) == 1


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="reactive.targets: signal"):
        ReactiveConfig(targets={"gpu": 1.0})
    with pytest.raises(ValueError, match=r"reactive.targets\[waiting\]"):
        ReactiveConfig(targets={"waiting": 0.0})
    with pytest.raises(ValueError, match="max_replicas"):
        AutoscalerConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="capacity_per_replica"):
        PredictiveConfig(enabled=True)
    with pytest.raises(ValueError, match="kv_usage"):
        MetricsSample(time=0.0, replicas=1, kv_usage=1.5)
    with pytest.raises(ValueError, match="current_replicas"):
        Autoscaler(AutoscalerConfig()).decide([], -1, 0.0)


# --- predictive -------------------------------------------------------------

DAY = 86400.0
PEAK_START, PEAK_TOP = 12 * 3600.0, 12.5 * 3600.0  # a ramp from 12:00 to a plateau at 12:30 until 14:00


def daily(t: float) -> float:
    """5 req/s at night, a ramp to 60 req/s over half an hour at noon, a 90-minute plateau."""
    s = t % DAY
    if PEAK_START <= s < PEAK_TOP:
        return 5.0 + 55.0 * (s - PEAK_START) / (PEAK_TOP - PEAK_START)
    if PEAK_TOP <= s < 14 * 3600.0:
        return 60.0
    return 5.0


def predictive_config(enabled: bool = True) -> AutoscalerConfig:
    return AutoscalerConfig(
        max_replicas=20,
        reactive=ReactiveConfig(targets={"request_rate": 10.0}),
        predictive=PredictiveConfig(enabled=enabled, capacity_per_replica=10.0, horizon_s=600.0, headroom=1.2,
                                    bucket_s=300.0, refit_interval_s=900.0),
    )


def _replay_history(scaler: Autoscaler, days: int, rng: random.Random) -> None:
    """Three days of scrapes (one a minute) fed to the scaler without deciding on them."""
    history = [MetricsSample(time=t, replicas=1, request_rate=max(0.0, daily(t) * rng.uniform(0.9, 1.1)))
               for t in range(0, int(days * DAY), 60)]
    scaler.decide(history, 1, history[-1].time)


@pytest.mark.parametrize("enabled", [True, False])
def test_predictive_scales_up_a_cold_start_before_the_daily_peak(enabled):
    scaler = Autoscaler(predictive_config(enabled))
    _replay_history(scaler, 3, random.Random(3))
    day4 = 3 * DAY
    run = simulate(scaler.config, daily, 2.5 * 3600, start=day4 + 11 * 3600, scaler=scaler,
                   start_replicas=1, noise=random.Random(4))
    horizon = scaler.config.predictive.horizon_s
    # A replica started at t - horizon is ready at t: the fleet decided then must carry the load at t.
    ready_short = [t for t in run.times if t - horizon >= run.times[0]
                   and run.at(t - horizon) * 10.0 < daily(t)]
    if enabled:
        assert not ready_short, f"short at {[(t - day4) / 3600 for t in ready_short[:5]]} h"
        needed = math.ceil(60.0 / 10.0)
        assert run.at(day4 + PEAK_TOP - horizon) >= needed
        first_up = next(t for t, n in zip(run.times, run.replicas) if n > 1)
        assert first_up <= day4 + PEAK_START - horizon + 300
        assert "holt-winters season 86400s" in run.decisions[-1].reason
    else:
        # Reactive alone reacts to the ramp only as it happens: short by a cold start.
        assert ready_short


def test_predictive_on_short_history_uses_the_trend_and_says_so():
    scaler = Autoscaler(predictive_config())
    too_short = [MetricsSample(time=t, replicas=1, request_rate=5.0) for t in range(0, 1200, 60)]
    decision = scaler.decide(too_short, 1, 1200)
    assert "history too short" in decision.reason and decision.predictive is None
    rising = [MetricsSample(time=t, replicas=1, request_rate=5.0 + t / 300.0) for t in range(0, 4 * 3600, 60)]
    decision = Autoscaler(predictive_config()).decide(rising, 2, rising[-1].time)
    assert "holt damped trend" in decision.reason
    # 52.8 req/s now and rising: the forecast over the next 10 min is above today's rate.
    assert decision.predictive is not None and decision.predictive >= math.ceil(53 * 1.2 / 10)
