"""A client that goes away mid-stream: the gateway closes the upstream
request, and the replica aborts it instead of generating to the end."""
from __future__ import annotations

import time

import httpx

from tests.gateway.conftest import GatewayProcess


def _aborted(replica) -> float:
    return replica.metrics().get("octavo:request_success_total[finished_reason=abort]", 0.0)


def test_client_disconnect_aborts_the_upstream_request(replicas, tmp_path):
    replica = replicas[2]
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", replica.url, "--no-cache")
    try:
        before = _aborted(replica)
        body = {"model": "tiny", "prompt": "go on", "max_tokens": 450, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the stream has started; now hang up
        deadline = time.monotonic() + 60
        while _aborted(replica) == before:
            assert time.monotonic() < deadline, "the replica never saw the abort"
            time.sleep(0.2)
        replica.wait_idle(60)  # and its KV blocks are free again
        in_flight = gw.metrics()[f"octavo_gateway:replica_in_flight[replica={replica.url}]"]
        assert in_flight == 0
    finally:
        gw.stop()
