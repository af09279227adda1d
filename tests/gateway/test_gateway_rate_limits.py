"""Token budgets under concurrency and abandonment, and limits on every route."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.gateway.conftest import GatewayProcess


def _gateway(tmp_path, replica: str, keys: str) -> GatewayProcess:
    config = tmp_path / "g.yaml"
    config.write_text(f"keys:\n{keys}cache: {{enabled: false}}\n")
    return GatewayProcess(tmp_path / "gw.log", "--replica", replica, "--config", str(config))


def _post(gw: GatewayProcess, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_concurrent_requests_reserve_tokens_and_settle_to_their_usage(echo, tmp_path):
    gw = _gateway(tmp_path, echo, "  - {key: sk-tokens, tpm: 100}\n")
    try:
        # Each reserves its prompt (a quarter of its 40-byte body) and max_tokens (45) while it runs: 100 tokens
        # admit two at once (the second leaves a debt that takes 7 s to refill), whatever their usage turns out to be.
        body = {"prompt": "sleep:4", "max_tokens": 45}
        with ThreadPoolExecutor(6) as pool:
            statuses = sorted(pool.map(lambda _: _post(gw, "sk-tokens", body).status_code, range(6)))
        assert statuses == [200, 200, 429, 429, 429, 429], statuses
        # Both used 2 tokens (the echo's usage): their reservations came back, the budget is there again.
        assert _post(gw, "sk-tokens", {"prompt": "x", "max_tokens": 40}).status_code == 200
    finally:
        gw.stop()


def test_an_abandoned_stream_is_charged_for_what_was_generated(replicas, tmp_path):
    gw = _gateway(tmp_path, replicas[0].url, "  - {key: sk-stream, tpm: 60}\n")
    try:
        body = {"model": "tiny", "prompt": "go on", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sk-stream"}) as r:
            lines = (line for line in r.iter_lines() if line)
            chunks = [next(lines) for _ in range(80)]  # 80 tokens read, then hang up
        assert all('"usage":{' not in c for c in chunks)  # the usage the gateway asked for stays hidden
        # At least 80 tokens cost against 60 per minute: a debt of 20+ tokens, 20+ s at one token per second.
        deadline = time.monotonic() + 30
        while (r := _post(gw, "sk-stream", {"prompt": "x"}, "/tokenize")).status_code != 429:
            assert time.monotonic() < deadline, "the abandoned stream was never charged"
            time.sleep(0.2)
        assert int(r.headers["retry-after"]) >= 15 and "tokens" in r.json()["error"]["message"]
    finally:
        gw.stop()


def test_every_route_of_a_key_is_rate_limited(replicas, tmp_path):
    gw = _gateway(tmp_path, replicas[0].url, "  - {key: sk-two, rpm: 2}\n")
    try:
        assert _post(gw, "sk-two", {"prompt": "hello"}, "/tokenize").status_code == 200
        assert _post(gw, "sk-two", {"tokens": [1, 2]}, "/detokenize").status_code == 200
        for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})):
            r = _post(gw, "sk-two", body, path)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        r = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": "Bearer sk-two"}, timeout=30)
        assert r.status_code == 429
    finally:
        gw.stop()
