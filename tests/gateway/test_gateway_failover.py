"""A replica killed with SIGKILL mid-run: no non-streaming request fails, its
breaker opens, and after a restart at the same address a probe closes it."""
from __future__ import annotations

import threading
import time

import httpx

from tests.gateway.conftest import GatewayProcess, start_replica
from tests.server.conftest import stop_all, wait_all_healthy


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_kill_one_replica_mid_run(model_path, tmp_path):
    replicas = wait_all_healthy([start_replica(model_path, tmp_path, f"r{i}", wait=False) for i in range(3)])
    config = tmp_path / "gateway.yaml"
    config.write_text("breaker: {failure_threshold: 2, cooldown_s: 1.0}\nprobe_interval_s: 0.5\ncache: {enabled: false}\n")
    gw = GatewayProcess(tmp_path / "gw.log", *(a for r in replicas for a in ("--replica", r.url)),
                        "--routing", "round-robin", "--config", str(config))
    victim = replicas[1]
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                r = http.post(f"{gw.url}/v1/completions", json={"prompt": "keep going", "max_tokens": 8})
                statuses.append(r.status_code)

    workers = [threading.Thread(target=client) for _ in range(4)]
    try:
        for w in workers:
            w.start()
        _wait_for(lambda: len(statuses) >= 12, 120, "requests before the kill")
        victim.proc.kill()  # SIGKILL: no drain, connections reset mid-request
        victim.proc.wait()
        killed_at = len(statuses)
        _wait_for(lambda: gw.breaker(victim.url) != "closed", 30, "the breaker to open")
        assert gw.metrics()[f"octavo_gateway:breaker_state[replica={victim.url}]"] in (1.0, 2.0)  # open / half-open
        _wait_for(lambda: len(statuses) >= killed_at + 24, 120, "requests after the kill")
        stop.set()
        for w in workers:
            w.join(timeout=120)
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
        errors = gw.metrics().get(f"octavo_gateway:replica_errors_total[replica={victim.url}]", 0)
        assert errors >= 1  # requests did go to it and failed over

        restarted = start_replica(model_path, tmp_path, "r1-again", port=victim.port)
        replicas[1] = restarted
        _wait_for(lambda: gw.breaker(victim.url) == "closed", 30, "the breaker to close after the restart")
        served = {httpx.post(f"{gw.url}/v1/completions", json={"prompt": "back", "max_tokens": 1},
                             timeout=60).headers["x-octavo-replica"] for _ in range(6)}
        assert victim.url in served
    finally:
        stop.set()
        gw.stop()
        stop_all(replicas)
