"""Replicas that misbehave without being broken: unusable URLs given to the
admin API, and replicas that answer 503 because they are busy."""
from __future__ import annotations

import time

import httpx

from tests.gateway.conftest import EchoUpstream, GatewayProcess
from tests.gateway.echo_upstream import OVERLOADED_RETRY_AFTER
from tests.server.conftest import free_port


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_unusable_replica_urls_are_refused_and_probes_go_on(echo, tmp_path):
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", echo, "--probe-interval-s", "0.2",
                        "--breaker-failure-threshold", "1", "--breaker-cooldown-s", "0.2")
    revived = None
    try:
        for url in ("http://127.0.0.1:99999", "http://bad host:80", "http://[::1", "http://user:pw@127.0.0.1:1",
                    "http://127.0.0.1:1/?q", "http://", "ftp://127.0.0.1:1", "http://\u00e9.example:80", 42):
            r = gw.admin("POST", {"url": url})
            assert r.status_code == 400 and r.json()["error"]["param"] == "url", (url, r.text)
        # Well-formed but unusable: not resolvable, TLS to a plain-HTTP port, nobody listening.
        port = free_port()
        dead = f"http://127.0.0.1:{port}"
        for url in ("http://no-such-host.invalid:8000", echo.replace("http://", "https://"), dead):
            assert gw.admin("POST", {"url": url}).status_code == 200
        _wait_for(lambda: gw.breaker(dead) != "closed", 30, "the dead replica's breaker to open")
        revived = EchoUpstream(tmp_path / "revived.log", port=port)
        _wait_for(lambda: gw.breaker(dead) == "closed", 30, "a probe to close the revived replica's breaker")
        assert "probe failed" not in gw.log()
    finally:
        gw.stop()
        if revived is not None:
            revived.stop()


def test_a_busy_replica_is_skipped_without_opening_its_breaker(echo, tmp_path):
    busy = EchoUpstream(tmp_path / "busy.log", overloaded=True)
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", busy.url, "--replica", echo, "--routing", "round-robin",
                        "--breaker-failure-threshold", "2", "--no-cache")
    try:
        for _ in range(8):  # half of them go to the busy replica first
            r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x"}, timeout=30)
            assert r.status_code == 200 and r.headers["x-octavo-replica"] == echo
        assert gw.breaker(busy.url) == "closed" and gw.breaker(echo) == "closed"
        assert gw.metrics().get(f"octavo_gateway:replica_errors_total[replica={busy.url}]", 0.0) == 0.0
        # Every replica busy: the client gets the replica's 503 and its Retry-After; still no breaker opens.
        assert gw.admin("DELETE", {"url": echo}).status_code == 200
        for _ in range(4):
            r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x"}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            assert r.headers["retry-after"] == OVERLOADED_RETRY_AFTER
        assert gw.breaker(busy.url) == "closed"
    finally:
        gw.stop()
        busy.stop()
