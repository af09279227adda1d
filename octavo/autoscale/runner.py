"""``octavo autoscale``: sample, decide, act, every ``interval_s``.

The loop owns the wall clock (the policy never reads one) and the short
window of samples the reactive policy averages over; the policy keeps its own
longer history for the forecaster.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from typing import Callable, Optional, Protocol

from octavo.autoscale.actuators.base import Actuator
from octavo.autoscale.config import AutoscaleConfig
from octavo.autoscale.gateway_admin import GatewayAdmin
from octavo.autoscale.policy import Autoscaler, ScaleDecision
from octavo.autoscale.refit import BackgroundFitter
from octavo.autoscale.samples import MetricsSample
from octavo.extras import require

logger = logging.getLogger("octavo.autoscale")


class Signals(Protocol):
    def sample(self, now: float) -> MetricsSample: ...


class ControlLoop:
    def __init__(self, autoscaler: Autoscaler, signals: Signals, actuator: Actuator, interval_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.autoscaler = autoscaler
        self.signals = signals
        self.actuator = actuator
        self.interval_s = interval_s
        self.clock = clock
        self.samples: deque[MetricsSample] = deque()

    def step(self) -> ScaleDecision:
        """One round: a sample, a decision (logged with its reason), the actuator told."""
        now = self.clock()
        self.samples.append(self.signals.sample(now))
        keep = self.autoscaler.config.reactive.metric_window_s + self.interval_s
        while self.samples and self.samples[0].time < now - keep:
            self.samples.popleft()
        current = self.actuator.replicas()
        decision = self.autoscaler.decide(list(self.samples), current, now)
        logger.info("decision: %s", decision.reason)
        if decision.replicas != current:
            self.actuator.scale(decision.replicas)
        return decision

    def run(self, stop: threading.Event) -> None:
        """Until ``stop`` is set; a failing round (metrics or actuator down) is
        logged and retried next interval, never fatal."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the loop must outlive a flaky Prometheus or API server
                logger.exception("autoscaling round failed")
            stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))


def build(config: AutoscaleConfig) -> ControlLoop:
    if config.actuator == "kubernetes":
        require("kubernetes", "autoscale", "the kubernetes actuator")
    if config.policy.predictive.enabled:
        require("statsmodels", "autoscale", "the predictive policy")
    actuator = build_actuator(config)
    # Fits run off the loop: a fit (statsmodels' import included) takes seconds, the interval must hold.
    autoscaler = Autoscaler(config.policy, BackgroundFitter())
    return ControlLoop(autoscaler, build_signals(config, actuator), actuator, config.interval_s)


def build_actuator(config: AutoscaleConfig) -> Actuator:
    if config.actuator == "kubernetes":
        from octavo.autoscale.actuators.kubernetes import KubernetesActuator, load_api

        return KubernetesActuator(config.kubernetes, load_api(config.kubernetes))
    from octavo.autoscale.actuators.local import LocalActuator

    return LocalActuator(config.local, _gateway_admin(config))


def build_signals(config: AutoscaleConfig, actuator: Actuator) -> Signals:
    from octavo.autoscale.signals import PrometheusSignals, ScrapeSignals

    if config.signals == "prometheus":
        return PrometheusSignals(str(config.prometheus_url))
    if config.actuator == "kubernetes":
        # Pods are not listed here: the gateway's (DNS-discovered) replica list is.
        admin = _gateway_admin(config)
        return ScrapeSignals(admin.replica_urls if admin else actuator.replica_urls, config.gateway_url)
    return ScrapeSignals(actuator.replica_urls, config.gateway_url)


def _gateway_admin(config: AutoscaleConfig) -> Optional[GatewayAdmin]:
    return GatewayAdmin(config.gateway_url, config.admin_key) if config.gateway_url else None


def run(config: AutoscaleConfig, stop: Optional[threading.Event] = None) -> None:
    """Until SIGTERM/SIGINT; local replicas are drained and stopped on the way out."""
    loop = build(config)
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    targets = ", ".join(f"{k}={v:g}" for k, v in config.policy.reactive.targets.items())
    logger.info("autoscaling %s replicas every %gs on %s%s", config.actuator, config.interval_s, targets,
                " + predictive" if config.policy.predictive.enabled else "")
    try:
        loop.run(stop)
    finally:
        loop.actuator.close()
