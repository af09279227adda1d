"""Tenant isolation: the admin API is never open to an empty key, cached
responses are never shared across API keys (only within a tenant), a stream
that failed is never replayed, and a usage chunk the client asked for is kept."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.conftest import GatewayProcess, raw_exchange

GREEDY = {"model": "tiny", "prompt": "whose answer", "max_tokens": 4, "temperature": 0}


def test_an_empty_admin_key_turns_the_admin_api_off(echo, tmp_path):
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", echo, admin_key="")
    try:
        for auth in (b"Authorization: Bearer \r\n", b"Authorization: Bearer\r\n", b""):
            status, answer = raw_exchange(gw.url, [b"GET /admin/replicas HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"])
            assert status == 404 and b"admin API is off" in answer
            add = b'{"url": "http://127.0.0.1:1"}'
            status, _ = raw_exchange(gw.url, [b"POST /admin/replicas HTTP/1.1\r\nHost: x\r\n" + auth +
                                              b"Content-Length: %d\r\n\r\n" % len(add) + add])
            assert status == 404
    finally:
        gw.stop()


@pytest.fixture
def keyed_gateway(echo, tmp_path):
    config = tmp_path / "g.yaml"
    config.write_text("keys:\n  - {key: sk-a}\n  - {key: sk-b}\n"
                      "  - {key: sk-team-1, tenant: team}\n  - {key: sk-team-2, tenant: team}\n")
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", echo, "--config", str(config))
    yield gw
    gw.stop()


def _post(gw: GatewayProcess, key: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def _hit(r: httpx.Response) -> bool:
    return r.headers.get("x-octavo-cache") == "hit"


def test_cached_responses_stay_with_their_key_or_tenant(keyed_gateway):
    assert not _hit(_post(keyed_gateway, "sk-a", GREEDY))
    assert _hit(_post(keyed_gateway, "sk-a", GREEDY))
    b = _post(keyed_gateway, "sk-b", GREEDY)  # the same request from another key: its own answer
    assert not _hit(b) and "x-octavo-replica" in b.headers
    assert _hit(_post(keyed_gateway, "sk-b", GREEDY))
    assert not _hit(_post(keyed_gateway, "sk-team-1", GREEDY))
    assert _hit(_post(keyed_gateway, "sk-team-2", GREEDY))  # one tenant, two keys: shared


def _stream(gw: GatewayProcess, key: str, body: dict) -> tuple[list[str], bool]:
    with httpx.stream("POST", f"{gw.url}/v1/completions", json={**body, "stream": True}, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line], _hit(r)


def test_a_stream_that_ended_in_an_error_is_never_replayed(keyed_gateway):
    died = {**GREEDY, "prompt": "engine dies"}
    for _ in range(2):
        events, hit = _stream(keyed_gateway, "sk-a", died)
        assert not hit and json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
    # The same stream, whole: replayed.
    fine = {**GREEDY, "prompt": "fine"}
    first, hit = _stream(keyed_gateway, "sk-a", fine)
    again, hit_again = _stream(keyed_gateway, "sk-a", fine)
    assert not hit and hit_again and again == first


def test_a_usage_chunk_asked_for_is_stored_and_replayed(replicas, tmp_path):
    """A key with a token budget makes the gateway ask for usage itself; a
    client that asked too gets its usage chunk, first time and from the cache."""
    config = tmp_path / "g.yaml"
    config.write_text("keys:\n  - {key: sk-metered, tpm: 100000}\n")
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", replicas[0].url, "--config", str(config))
    try:
        body = {**GREEDY, "prompt": "count my tokens", "max_tokens": 6}
        plain, _ = _stream(gw, "sk-metered", body)
        assert not any('"usage":{' in e for e in plain)
        asked = {**body, "stream_options": {"include_usage": True}}
        direct = httpx.post(f"{replicas[0].url}/v1/completions", json={**asked, "stream": True}, timeout=60)
        want_usage = [json.loads(e.removeprefix("data: "))["usage"] for e in direct.text.split("\n\n")
                      if '"usage":{' in e]
        for expect_hit in (False, True):
            events, hit = _stream(gw, "sk-metered", asked)
            assert hit == expect_hit
            usage = [json.loads(e.removeprefix("data: "))["usage"] for e in events if '"usage":{' in e]
            assert usage == want_usage and len(usage) == 1  # the closing chunk only, as the replica sends it
    finally:
        gw.stop()
