"""The control loop keeps its interval while the forecaster fits: a slow fit
runs on its own thread, decisions meanwhile say so, and the forecast is used
as soon as it is ready."""
from __future__ import annotations

import threading
import time

from octavo.autoscale.actuators.base import Actuator
from octavo.autoscale.forecast import Forecast
from octavo.autoscale.policy import Autoscaler, AutoscalerConfig, MetricsSample, PredictiveConfig, ReactiveConfig
from octavo.autoscale.refit import BackgroundFitter, FitJob
from octavo.autoscale.runner import ControlLoop

INTERVAL_S = 0.1
FIT_S = 0.8


class FixedReplicas(Actuator):
    def __init__(self) -> None:
        self.count = 2

    def replicas(self) -> int:
        return self.count

    def scale(self, replicas: int) -> None:
        self.count = replicas


class SteadyRate:
    """A scrape per decision, 5 req/s, timed so the test can see the loop's rhythm."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def sample(self, now: float) -> MetricsSample:
        self.times.append(time.monotonic())
        return MetricsSample(time=now, replicas=2, request_rate=5.0)


def test_a_slow_fit_does_not_stretch_the_interval(monkeypatch):
    fitted = threading.Event()

    def slow_fit(job: FitJob) -> Forecast:
        time.sleep(FIT_S)
        fitted.set()
        return Forecast((job.first_index + len(job.values)) * job.bucket_s, job.bucket_s, (40.0,) * job.steps, "slow")

    monkeypatch.setattr(FitJob, "run", slow_fit)
    config = AutoscalerConfig(
        min_replicas=1, max_replicas=10, reactive=ReactiveConfig(targets={"request_rate": 10.0}),
        predictive=PredictiveConfig(enabled=True, capacity_per_replica=10.0, horizon_s=1.0, bucket_s=0.01,
                                    refit_interval_s=60.0),
        scale_up_window_s=0.0,
    )
    scaler = Autoscaler(config, BackgroundFitter())
    signals = SteadyRate()
    loop = ControlLoop(scaler, signals, FixedReplicas(), INTERVAL_S, clock=time.time)
    decisions = []
    original_step = loop.step
    monkeypatch.setattr(loop, "step", lambda: decisions.append(original_step()) or decisions[-1])
    # A history long enough to fit on: the first decision starts the fit.
    start = time.time()
    loop.samples.extend(MetricsSample(time=start - 1.0 + i * 0.01, replicas=2, request_rate=5.0) for i in range(100))

    stop = threading.Event()
    runner = threading.Thread(target=loop.run, args=(stop,))
    runner.start()
    assert fitted.wait(5.0)
    time.sleep(3 * INTERVAL_S)
    stop.set()
    runner.join(5.0)

    gaps = [b - a for a, b in zip(signals.times, signals.times[1:])]
    assert len(gaps) >= FIT_S / INTERVAL_S - 1
    assert max(gaps) < INTERVAL_S + 0.15, gaps
    assert any("predictive: fitting" in d.reason for d in decisions[:3])
    # The forecast (40 req/s x 1.2 / 10 per replica) drives the decisions once ready.
    assert decisions[-1].predictive == 5 and "slow" in decisions[-1].reason
