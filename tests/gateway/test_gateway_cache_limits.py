"""Response cache (memory and Redis shared by two gateways) and per-key rate limits."""
from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import GatewayProcess, RedisProcess

GREEDY = {"model": "tiny", "prompt": "cache me", "max_tokens": 8, "temperature": 0}


def _prompt_tokens(replicas) -> float:
    return sum(r.metrics()["octavo:prompt_tokens_total"] for r in replicas)


def _post(gw: GatewayProcess, body: dict, **headers: str) -> httpx.Response:
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _stream_text(gw: GatewayProcess, body: dict) -> tuple[str, bool]:
    chunks = []
    with httpx.stream("POST", f"{gw.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        hit = r.headers.get("x-octavo-cache") == "hit"
        chunks = [line for line in r.iter_lines() if line]
    assert chunks[-1] == "data: [DONE]"
    return "\n".join(chunks), hit


@pytest.fixture(scope="module")
def cached_gateway(replicas, tmp_path_factory):
    args = [a for r in replicas for a in ("--replica", r.url)]
    gw = GatewayProcess(tmp_path_factory.mktemp("gw") / "gw.log", *args)
    yield gw
    gw.stop()


def test_second_greedy_request_is_served_from_the_cache(cached_gateway, replicas):
    first = _post(cached_gateway, GREEDY)
    before = _prompt_tokens(replicas)
    second = _post(cached_gateway, GREEDY)
    assert second.headers["x-octavo-cache"] == "hit" and "x-octavo-replica" not in second.headers
    assert second.json() == first.json()
    assert _prompt_tokens(replicas) == before  # no replica saw it
    # The same request with another key order, priority or user is the same request.
    reordered = dict(reversed(list(GREEDY.items())), user="someone")
    assert _post(cached_gateway, reordered).headers.get("x-octavo-cache") == "hit"


def test_no_cache_header_skips_the_cache(cached_gateway, replicas):
    _post(cached_gateway, GREEDY)
    before = _prompt_tokens(replicas)
    r = _post(cached_gateway, GREEDY, **{"Cache-Control": "no-cache"})
    assert "x-octavo-cache" not in r.headers
    assert _prompt_tokens(replicas) > before


def test_sampled_requests_are_never_cached_and_seeded_ones_are(cached_gateway):
    sampled = {**GREEDY, "temperature": 1.0}
    for _ in range(3):
        assert "x-octavo-cache" not in _post(cached_gateway, sampled).headers
    seeded = {**sampled, "seed": 7}
    first = _post(cached_gateway, seeded)
    second = _post(cached_gateway, seeded)
    assert second.headers.get("x-octavo-cache") == "hit" and second.json() == first.json()


def test_streamed_hit_replays_the_same_events(cached_gateway):
    body = {**GREEDY, "prompt": "stream me"}
    first, hit1 = _stream_text(cached_gateway, body)
    second, hit2 = _stream_text(cached_gateway, body)
    assert not hit1 and hit2 and second == first


def test_redis_cache_is_shared_by_two_gateways(replicas, tmp_path):
    redis = RedisProcess(tmp_path / "redis.log")
    args = ["--replica", replicas[0].url, "--redis-url", redis.url]
    gateways = [GatewayProcess(tmp_path / f"gw{i}.log", *args) for i in range(2)]
    try:
        body = {**GREEDY, "prompt": "shared through redis"}
        first = _post(gateways[0], body)
        assert "x-octavo-cache" not in first.headers
        before = _prompt_tokens(replicas)
        second = _post(gateways[1], body)
        assert second.headers.get("x-octavo-cache") == "hit" and second.json() == first.json()
        assert _prompt_tokens(replicas) == before
    finally:
        for gw in gateways:
            gw.stop()
        redis.stop()


def _limits_config(tmp_path, extra: str = "") -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "keys:\n"
        "  - {key: sk-three-rpm, rpm: 3}\n"
        "  - {key: sk-tokens, tpm: 50}\n"
        "  - {key: sk-batch, priority: 5}\n"
        "cache: {enabled: false}\n" + extra
    )
    return str(path)


def _call(gw: GatewayProcess, key: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": "tiny", "prompt": "abcdefghij", "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(f"{gw.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.mark.parametrize("shared", [False, True], ids=["memory", "redis"])
def test_rate_limits(replicas, tmp_path, shared):
    redis = RedisProcess(tmp_path / "redis.log") if shared else None
    args = ["--replica", replicas[0].url, "--config", _limits_config(tmp_path)]
    gw = GatewayProcess(tmp_path / "gw.log", *args, *(["--redis-url", redis.url] if redis else []))
    try:
        assert _call(gw, "sk-unknown").status_code == 401
        # Requests per minute: exactly the budget passes, then 429 with Retry-After.
        assert [_call(gw, "sk-three-rpm").status_code for _ in range(3)] == [200, 200, 200]
        refused = _call(gw, "sk-three-rpm")
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["Retry-After"]) <= 20  # one request refills in 60/3 s
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        # Tokens per minute (50), charged from usage: the prompt + 20 completion tokens per call.
        ok = _call(gw, "sk-tokens", max_tokens=20)
        used = ok.json()["usage"]["total_tokens"]
        assert ok.status_code == 200 and 25 <= used < 50
        # 50 - used > 0 left: admitted. A stream is charged too, its usage asked for
        # upstream and kept from a client that did not ask for it.
        body = {"model": "tiny", "prompt": "abcdefghij", "max_tokens": 20, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sk-tokens"}) as r:
            events = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        assert not any('"usage":{' in e for e in events)
        over = _call(gw, "sk-tokens", max_tokens=20)  # 50 - 2 * used <= 0 left
        assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
        assert "tokens" in over.json()["error"]["message"]
        # A key without limits is never refused.
        assert all(_call(gw, "sk-batch").status_code == 200 for _ in range(5))
        refused_metric = {k: v for k, v in gw.metrics().items() if k.startswith("octavo_gateway:rate_limited_total")}
        assert refused_metric == {"octavo_gateway:rate_limited_total[limit=requests]": 1.0,
                                  "octavo_gateway:rate_limited_total[limit=tokens]": 1.0}
    finally:
        gw.stop()
        if redis:
            redis.stop()
