"""The gateway's parts without processes: policies, breaker, buckets, cache, config."""
from __future__ import annotations

import asyncio
import json

import pytest

from octavo.core.prefix_hash import extend_block_hashes
from octavo.gateway.cache import MemoryCache, cache_key, is_deterministic
from octavo.entrypoints.cli import build_parser, gateway_config, parse_command
from octavo.gateway.config import BreakerConfig, CacheConfig, GatewayConfig, KeyConfig
from octavo.gateway.kv_index import KVIndex
from octavo.gateway.ratelimit import MemoryBuckets, RateLimiter, retry_after_header
from octavo.gateway.replica_url import normalize_url
from octavo.gateway.replicas import Breaker, BreakerState, Replica, ReplicaSet
from octavo.gateway.routing import KVAware, LeastLoad, PrefixAffinity, RouteInput, Session
from octavo.gateway.usage import UNBOUNDED_OUTPUT_TOKENS, reservation
from octavo.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


def _replicas(*loads: int) -> list[Replica]:
    out = []
    for i, load in enumerate(loads):
        r = Replica(f"http://r{i}", Breaker(BreakerConfig()))
        r.running = load
        out.append(r)
    return out


def test_least_load_and_the_gateway_s_own_in_flight_count():
    a, b = _replicas(3, 1)
    assert LeastLoad().choose(RouteInput(), [a, b]).replica is b
    b.in_flight = 5  # sent since the last scrape: not in its scraped queue yet
    assert b.load == 6 and LeastLoad().choose(RouteInput(), [a, b]).replica is a
    b.running, b.in_flight_at_scrape = 5, 5  # scraped since: the queue counts them already
    assert b.load == 5
    b.in_flight = 2  # three finished since that scrape
    assert b.load == 2


def test_kv_aware_weighs_the_cached_prefix_against_the_queue():
    index = KVIndex()
    tokens = list(range(100))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 16, 6)
    a, b, c = _replicas(0, 0, 0)
    index.apply(a.url, EventBatch(0.0, [BlockStored(hashes[:2], None, [], 16)]))
    index.apply(b.url, EventBatch(0.0, [BlockStored(hashes[:5], None, [], 16)]))
    policy = KVAware(index, 16, max_imbalance=2)
    decision = policy.choose(RouteInput(token_ids=tokens), [a, b, c])
    assert (decision.replica, decision.reason) == (b, "kv_hit")
    # Running requests share steps but queue no prefill ahead: b keeps its 80 cached tokens.
    b.running = 1
    assert policy.choose(RouteInput(token_ids=tokens), [a, b, c]).replica is b
    # A waiting request counts as the mean prefill routed so far: 4 tokens while every request hit b (its 5
    # blocks from events, the sixth sent to it), so one waiting there leaves b its 64 extra cached tokens over a:
    # a returning tenant stays with its prefix.
    b.running, b.waiting = 0, 1
    assert policy.choose(RouteInput(token_ids=tokens), [a, b, c]).replica is b
    # Prompts nobody holds raise the mean prefill to (3 * 4 + 8 * 100) / 11 = 74 tokens: b's queue now
    # outweighs its extra prefix.
    for i in range(1, 9):
        assert policy.choose(RouteInput(token_ids=list(range(1000 * i, 1000 * i + 100))), [a, c]).reason == "kv_miss"
    assert policy.choose(RouteInput(token_ids=tokens), [a, b, c]).replica is a
    # Beyond max_imbalance a replica is out whatever it holds.
    b.waiting, a.running = 0, 3
    decision = policy.choose(RouteInput(token_ids=tokens), [a, b, c])
    assert decision.replica is b
    b.running = 3 + 3
    decision = policy.choose(RouteInput(token_ids=tokens), [a, b, c])
    assert (decision.replica, decision.reason) == (c, "kv_overloaded")


def test_kv_aware_follows_a_tenant_s_first_request_before_its_events_arrive():
    now = [0.0]
    index = KVIndex()
    a, b = _replicas(0, 0)
    policy = KVAware(index, 16, max_imbalance=4, in_flight_s=30.0, clock=lambda: now[0])
    tenant = list(range(200))
    first = policy.choose(RouteInput(token_ids=tenant + [1000]), [a, b])
    assert first.reason == "kv_miss"
    # The second request of the tenant follows the first, though no event has arrived yet.
    second = policy.choose(RouteInput(token_ids=tenant + [2000]), [b, a])
    assert (second.replica, second.reason) == (first.replica, "kv_hit")
    # A new tenant goes where the queue is shorter.
    first.replica.waiting = 1
    other = policy.choose(RouteInput(token_ids=list(range(500, 700))), [a, b])
    assert other.replica is not first.replica and other.reason == "kv_miss"
    # What was sent long ago and never confirmed by an event is forgotten.
    first.replica.waiting = 0
    now[0] = 31.0
    assert policy.choose(RouteInput(token_ids=tenant + [3000]), [a, b]).reason == "kv_miss"


def test_kv_index_holds_a_block_while_any_medium_does():
    """A block the pool evicts into host memory stays routable; it is gone
    once neither the pool, host memory nor disk holds it."""
    index = KVIndex()
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(48)), 16, 3)
    index.apply("r", EventBatch(0.0, [BlockStored(hashes, None, list(range(48)), 16)]))
    index.apply("r", EventBatch(0.0, [BlockRemoved(hashes[1:]), BlockStored(hashes[1:], None, [], 16, medium="cpu")]))
    assert index.matched_blocks("r", hashes) == 3
    index.apply("r", EventBatch(0.0, [BlockRemoved([hashes[2]], medium="cpu"),
                                      BlockStored([hashes[2]], None, [], 16, medium="disk")]))
    assert index.matched_blocks("r", hashes) == 3
    index.apply("r", EventBatch(0.0, [BlockRemoved([hashes[1]], medium="cpu")]))
    assert index.matched_blocks("r", hashes) == 1 and index.num_blocks("r") == 2


def test_prefix_policy_follows_the_leading_chunks():
    a, b = _replicas(0, 0)
    policy = PrefixAffinity(chunk_bytes=8, max_imbalance=1)
    first = policy.choose(RouteInput(prompt_bytes=b"shared system prompt / one"), [a, b])
    again = policy.choose(RouteInput(prompt_bytes=b"shared system prompt / two"), [a, b])
    assert again.replica is first.replica and again.reason == "prefix_hit"
    first.replica.running = 5
    assert policy.choose(RouteInput(prompt_bytes=b"shared system prompt / 3"), [a, b]).replica is not first.replica


def test_session_is_sticky():
    replicas = _replicas(0, 0, 0)
    policy = Session(max_imbalance=4)
    owner = policy.choose(RouteInput(session="u1"), replicas).replica
    assert all(policy.choose(RouteInput(session="u1"), replicas).replica is owner for _ in range(5))
    rest = [r for r in replicas if r is not owner]
    assert policy.choose(RouteInput(session="u1"), rest).reason == "session_new"  # owner gone: moves


def test_breaker_opens_cools_down_and_closes_on_a_good_probe():
    b = Breaker(BreakerConfig(failure_threshold=2, cooldown_s=10))
    b.record_failure(now=0)
    assert b.state == BreakerState.CLOSED
    b.record_failure(now=1)
    assert b.state == BreakerState.OPEN and not b.allows_requests()
    assert not b.due_for_trial(now=5)
    assert b.due_for_trial(now=11) and b.state == BreakerState.HALF_OPEN
    b.record_failure(now=12)  # the trial failed: open again for another cool-down
    assert b.state == BreakerState.OPEN and not b.due_for_trial(now=15)
    assert b.due_for_trial(now=22)
    b.record_success()
    assert b.state == BreakerState.CLOSED and b.failures == 0


def test_token_buckets_admit_the_budget_and_charge_usage():
    limiter = RateLimiter(MemoryBuckets())
    key = KeyConfig("k", rpm=2, tpm=100)

    async def run():
        assert await limiter.admit(key, 0) is None
        assert await limiter.admit(key, 0) is None
        refused = await limiter.admit(key, 0)
        assert refused.limit == "requests" and 0 < refused.retry_after_s <= 30
        other = KeyConfig("k2", tpm=100)
        assert await limiter.admit(other, 10) is None
        await limiter.settle(other, 10, 150)  # usage beyond the budget: a debt
        refused = await limiter.admit(other, 0)
        assert refused.limit == "tokens" and refused.retry_after_s > 60 * 50 / 100 - 1

    asyncio.run(run())
    assert retry_after_header(0.2) == "1" and retry_after_header(2.1) == "3"


def test_memory_cache_is_bounded_and_expires():
    async def run():
        cache = MemoryCache(CacheConfig(max_entries=2, max_bytes=10, ttl_s=0.05))
        await cache.put("a", b"1234")
        await cache.put("b", b"5678")
        assert await cache.get("a") == b"1234"  # a is now the most recent
        await cache.put("c", b"9")
        assert await cache.get("b") is None and await cache.get("a") == b"1234"
        await cache.put("d", b"0123456")  # over the byte bound: the oldest go
        assert await cache.get("a") is None and await cache.get("d") == b"0123456"
        await asyncio.sleep(0.06)
        assert await cache.get("d") is None

    asyncio.run(run())


def test_what_counts_as_deterministic_and_the_key():
    assert is_deterministic({"temperature": 0}) and is_deterministic({"temperature": 1, "seed": 3})
    assert not is_deterministic({}) and not is_deterministic({"temperature": 0.7})
    assert cache_key("", "/v1/completions", {"a": 1, "b": 2}) == cache_key("", "/v1/completions", {"b": 2, "a": 1})
    assert cache_key("", "/v1/completions", {"a": 1}) != cache_key("", "/v1/chat/completions", {"a": 1})
    assert cache_key("key:a", "/v1/completions", {"a": 1}) != cache_key("key:b", "/v1/completions", {"a": 1})


def _parse(*argv: str):
    return parse_command(build_parser(), ["gateway", *argv])[0]


def test_config_file_and_command_line(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("replicas: [http://a:1]\nrouting: session\nbreaker: {failure_threshold: 5}\n"
                    "keys:\n  - {key: k1, rpm: 10, priority: 2}\n")
    config = gateway_config(_parse("--config", str(path), "--replica", "b:2", "--port", "9"))
    assert config.replicas == ["http://a:1", "http://b:2"] and config.port == 9 and config.routing == "session"
    assert config.breaker.failure_threshold == 5 and config.keys == [KeyConfig("k1", rpm=10, priority=2)]
    path.write_text("breaker: {failure_treshold: 5}\n")
    with pytest.raises(ValueError, match="unknown option 'breaker.failure_treshold' \\(did you mean 'failure_threshold'"):
        _parse("--config", str(path))
    with pytest.raises(ValueError, match="routing must be one of"):
        GatewayConfig(routing="random")
    with pytest.raises(ValueError, match="kv-aware needs tokenizer"):
        GatewayConfig(routing="kv-aware")
    with pytest.raises(ValueError, match="rpm must be >= 1"):
        KeyConfig("k", rpm=0)


def test_replica_set_normalizes_urls():
    replicas = ReplicaSet(BreakerConfig())
    replicas.add("127.0.0.1:8000/")
    assert [r.url for r in replicas] == ["http://127.0.0.1:8000"]
    assert replicas.remove("http://127.0.0.1:8000") and len(replicas) == 0
    with pytest.raises(ValueError, match="http"):
        normalize_url("ftp://x")


def test_dns_discovery_adds_addresses_and_leaves_static_replicas_alone():
    from octavo.gateway.health import discovery_loop

    replicas = ReplicaSet(BreakerConfig())
    replicas.add("http://static:1")

    async def run():
        task = asyncio.create_task(discovery_loop("localhost", 1234, replicas, interval_s=0.01))
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(run())
    urls = {r.url for r in replicas}
    assert "http://static:1" in urls and "http://127.0.0.1:1234" in urls


def test_a_request_without_an_output_bound_reserves_a_bounded_share():
    # Chat clients mostly send no max_tokens: such a request reserves its prompt and UNBOUNDED_OUTPUT_TOKENS
    # (it was a TypeError, a 500, under a token limit), so several run side by side within a key's minute.
    body = {"messages": [{"role": "user", "content": "hi"}]}
    raw = json.dumps(body).encode()
    reserve = reservation("/v1/chat/completions", body, raw)
    assert reserve == len(raw) // 4 + 1 + UNBOUNDED_OUTPUT_TOKENS
    assert reservation("/v1/chat/completions", {**body, "max_tokens": 10, "n": 2}, raw) == len(raw) // 4 + 1 + 20
    key = KeyConfig("sk", tpm=3 * reserve + reserve // 2)  # admits while above zero: the fourth runs into debt
    limiter = RateLimiter(MemoryBuckets())

    async def run() -> list[bool]:
        admitted = [await limiter.admit(key, reserve) is None for _ in range(5)]
        for _ in range(4):
            await limiter.settle(key, reserve, 50)  # each used 50 tokens: the rest of its reservation comes back
        return admitted + [await limiter.admit(key, reserve) is None]

    assert asyncio.run(run()) == [True, True, True, True, False, True]
