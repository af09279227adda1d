"""End to end on this machine: a real gateway, `octavo serve` replicas started
and stopped by the local actuator, the control loop reading their /metrics.

A burst through the gateway makes the autoscaler start a second replica, the
gateway routes requests to it; when the burst ends it is drained and stopped
while a trickle of requests keeps flowing, and none of them fails."""
from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import httpx

from octavo.autoscale.actuators.local import LocalActuator, LocalConfig, State
from octavo.autoscale.gateway_admin import GatewayAdmin
from octavo.autoscale.policy import Autoscaler, AutoscalerConfig, ReactiveConfig
from octavo.autoscale.runner import ControlLoop
from octavo.autoscale.signals import ScrapeSignals
from tests.gateway.conftest import ADMIN_KEY, GatewayProcess
from tests.model_factory import make_tiny_model
from tests.server.conftest import REPO


class Load:
    """``clients`` threads each sending completions back to back through the
    gateway, keeping every status code."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        with httpx.Client(timeout=120.0) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(f"{self.url}/v1/completions", json={
                        "model": "tiny", "prompt": "def f(x):", "max_tokens": 128, "temperature": 0,
                        "ignore_eos": True})
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.errors.append(r.text[:300])
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def _wait(predicate, timeout_s: float, what: str, log: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{log}")
        time.sleep(0.2)


def _routed_to(gateway: GatewayProcess, replica_url: str) -> float:
    return sum(v for k, v in gateway.metrics().items()
               if k.startswith("octavo_gateway:requests_total") and f"[replica={replica_url}]" in k)


def test_burst_starts_a_replica_that_serves_then_it_drains_without_failures(tmp_path: Path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="octavo.autoscale")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = make_tiny_model(tmp_path / "model")
    # No replica yet: its /health is 503 until the autoscaler registers one.
    gateway = GatewayProcess(tmp_path / "gateway.log", "--routing", "least-load", "--no-cache", wait=False)
    actuator = LocalActuator(
        LocalConfig(serve_args=(str(model), "--dtype", "float32", "--num-blocks", "256", "--served-model-name",
                                "tiny", "--log-level", "warning"),
                    log_dir=str(tmp_path / "replicas"), start_timeout_s=120.0, drain_timeout_s=60.0),
        GatewayAdmin(gateway.url, ADMIN_KEY),
    )
    # Short windows for a short test: 1 s decisions on a 2 s mean; down after 4 s of lower recommendations.
    policy = AutoscalerConfig(
        min_replicas=1, max_replicas=2, scale_down_window_s=4.0, scale_up_period_s=1.0, scale_down_period_s=1.0,
        reactive=ReactiveConfig(targets={"in_flight": 2.0}, metric_window_s=2.0),
    )
    loop = ControlLoop(Autoscaler(policy), ScrapeSignals(actuator.replica_urls, gateway.url), actuator, 1.0)
    decisions = []
    stop = threading.Event()

    def control() -> None:
        while not stop.is_set():
            decisions.append(loop.step())
            stop.wait(1.0)

    controller = threading.Thread(target=control, daemon=True)
    controller.start()
    burst = trickle = None
    try:
        # No replica at start: the minimum is started and registered.
        _wait(lambda: len(actuator.replica_urls()) == 1, 120, "the first replica", gateway.log())
        first = actuator.replica_urls()[0]

        burst = Load(gateway.url, clients=6)
        _wait(lambda: len(actuator.replica_urls()) == 2, 120, "a second replica",
              caplog.text[-3000:])
        second = next(u for u in actuator.replica_urls() if u != first)
        assert any("in_flight" in d.reason and d.replicas == 2 for d in decisions)
        _wait(lambda: _routed_to(gateway, second) >= 3, 60, "requests routed to the second replica")
        burst.stop()

        # The trickle (one client, ~1 in flight < the target 2) keeps going through the scale-down.
        trickle = Load(gateway.url, clients=1)
        _wait(lambda: actuator.states()[second] is State.STOPPED, 120, "the second replica drained and stopped",
              caplog.text[-3000:])
        served_during_drain = len(trickle.statuses)
        time.sleep(1.0)
        trickle.stop()
        assert served_during_drain > 0
        assert burst.errors == [] and trickle.errors == []
        assert set(burst.statuses) == {200} and set(trickle.statuses) == {200}
        assert actuator.states()[first] is State.READY
        assert [r["url"] for r in gateway.admin("GET").json()["replicas"]] == [first]
        assert any(d.replicas == 1 and "2 -> 1" in d.reason for d in decisions)
    finally:
        for load in (burst, trickle):
            if load is not None:
                load.stop()
        stop.set()
        controller.join(timeout=30)
        actuator.close()
        gateway.stop()
    # close() drained the last replica too: every process this test started has exited.
    assert set(actuator.states().values()) == {State.STOPPED}


def test_a_replica_that_dies_is_counted_out(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = make_tiny_model(tmp_path / "model")
    actuator = LocalActuator(LocalConfig(serve_args=(str(model), "--dtype", "float32", "--num-blocks", "64"),
                                         start_timeout_s=120.0), gateway=None)
    try:
        actuator.scale(1)
        _wait(lambda: len(actuator.replica_urls()) == 1, 120, "the replica")
        (replica,) = actuator._replicas  # the process it started, stopped behind its back
        replica.process.send_signal(signal.SIGTERM)
        replica.process.wait(60)
        # Counted out at once: the next decision sees 0 and starts a replacement.
        assert actuator.replicas() == 0 and actuator.replica_urls() == []
        assert actuator.states()[replica.url] is State.STOPPED
    finally:
        actuator.close()


def test_a_replica_that_cannot_start_is_named_with_its_reason_and_backed_off(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    missing = tmp_path / "no-such-model"
    actuator = LocalActuator(LocalConfig(serve_args=(str(missing),), start_timeout_s=60.0), gateway=None)
    try:
        with caplog.at_level(logging.ERROR):
            actuator.scale(1)
            _wait(lambda: set(actuator.states().values()) == {State.STOPPED}, 60, "the failed start")
            actuator.scale(1)  # within the back-off: nothing new is started
        assert len(actuator.states()) == 1
        [line] = [r.getMessage() for r in caplog.records if "while starting" in r.getMessage()]
        assert f"octavo: error: model folder not found: {missing}" in line and "replica-" in line
        assert "next start in 5 s" in line
    finally:
        actuator.close()
