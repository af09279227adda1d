"""The autoscaler in the loop: octavo/autoscale/policy.py's ``Autoscaler``,
the object `octavo autoscale` runs, fed the simulated fleet's samples on the
simulated clock. Its decisions (and why) are kept for the summary."""
from __future__ import annotations

from typing import Sequence

from octavo.autoscale.policy import Autoscaler, MetricsSample, ScaleDecision
from octavo.simulate.simulator import FleetSample


def metrics_sample(sample: FleetSample, interval_s: float) -> MetricsSample:
    """What a Prometheus scrape of the fleet would have shown at the sample's time."""
    return MetricsSample(
        time=sample.time,
        replicas=sample.ready,
        request_rate=sample.arrivals / interval_s,
        waiting=float(sample.waiting),
        running=float(sample.running),
        kv_usage=min(1.0, max(0.0, sample.kv_usage)),
        ttft_p99=sample.ttft_p99,
    )


class PolicyScaler:
    """A ``Scaler`` (simulator.py) deciding with an ``Autoscaler``."""

    def __init__(self, autoscaler: Autoscaler, interval_s: float) -> None:
        self.autoscaler = autoscaler
        self._interval_s = interval_s
        self._samples: list[MetricsSample] = []
        self.decisions: list[ScaleDecision] = []

    def target(self, history: Sequence[FleetSample], current: int, now: float) -> int:
        # The simulator hands over its whole history each time; only the newest sample is new.
        self._samples.append(metrics_sample(history[-1], self._interval_s))
        decision = self.autoscaler.decide(self._samples, current, now)
        if decision.replicas != current:
            self.decisions.append(decision)
        return decision.replicas
