"""kv-aware routing end to end: replicas publish KV events, the gateway routes
each prompt family to the replica holding its prefix (measured by the
replicas' own prefix-cache hits), where round-robin finds it about 1/3 of the time."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from octavo.tokenizer import Tokenizer
from tests.gateway.conftest import GatewayProcess, start_replica
from tests.server.conftest import free_port, stop_all, wait_all_healthy

BLOCK = 16
FAMILIES = 10
ROUNDS = 4  # the first request of a family finds nothing; the other three can hit


def _families(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    # Distinct from the first character on, so families share no block.
    return [f"{chr(65 + i)}{seed} " + " ".join(rng.choice(words) for _ in range(40)) for i in range(FAMILIES)]


def _hits(replicas) -> float:
    return sum(r.wait_idle(60)["octavo:prefix_cache_hits_total"] for r in replicas)


def _run(gw: GatewayProcess, replicas, tokenizer: Tokenizer, seed: int) -> float:
    """Share of the prefix tokens the follow-up requests could have hit that they did hit."""
    prefixes = _families(seed)
    before = _hits(replicas)
    seen: dict[int, list[list[int]]] = {}
    possible = 0
    for round_ in range(ROUNDS):
        for f, prefix in enumerate(prefixes):  # interleaved: each family once per round
            prompt = f"{prefix} | question {round_}{f}?"
            ids = tokenizer.encode(prompt)
            # What a replica that served this family before holds: full blocks of the longest common prefix
            # (never the last token, which is always computed).
            best = max((_common(ids, old) for old in seen.get(f, [])), default=0)
            possible += min(best, len(ids) - 1) // BLOCK * BLOCK
            seen.setdefault(f, []).append(ids)
            r = httpx.post(f"{gw.url}/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
    assert possible > FAMILIES * (ROUNDS - 1) * 100  # long shared prefixes
    return (_hits(replicas) - before) / possible


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def kv_replicas(model_path, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("kv-replicas")
    procs, endpoints = [], []
    for i in range(3):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        procs.append(start_replica(model_path, log_dir, f"kv{i}", "--kv-events-endpoint", endpoint,
                                   "--block-size", str(BLOCK), "--num-blocks", "512", wait=False))
        endpoints.append(endpoint)
    wait_all_healthy(procs)
    yield procs, endpoints
    stop_all(procs)


def _wait_subscribed(gw: GatewayProcess, replicas, tokenizer) -> None:
    """ZMQ subscriptions take a moment: until a probe request's blocks show up in the index."""
    deadline = time.monotonic() + 30
    probe = "subscription probe " * 4
    while time.monotonic() < deadline:
        for r in replicas:
            httpx.post(f"{r.url}/v1/completions", json={"prompt": probe, "max_tokens": 1}, timeout=60)
        view = gw.admin("GET").json()["replicas"]
        if all(x["kv_blocks"] > 0 for x in view):
            return
        time.sleep(0.5)
    raise AssertionError(f"KV events never arrived: {gw.admin('GET').json()}")


def test_kv_aware_routes_families_to_their_prefix(kv_replicas, model_path, tmp_path):
    replicas, endpoints = kv_replicas
    tokenizer = Tokenizer(model_path)
    events = [a for r, e in zip(replicas, endpoints) for a in ("--kv-events", f"{r.url}={e}")]
    kv = GatewayProcess(tmp_path / "kv.log", *events, "--routing", "kv-aware", "--tokenizer", str(model_path),
                        "--no-cache")
    try:
        _wait_subscribed(kv, replicas, tokenizer)
        kv_share = _run(kv, replicas, tokenizer, seed=1)
        decisions = {k: v for k, v in kv.metrics().items() if k.startswith("octavo_gateway:routing_decisions_total")}
    finally:
        kv.stop()
    rr = GatewayProcess(tmp_path / "rr.log", *(a for r in replicas for a in ("--replica", r.url)),
                        "--routing", "round-robin", "--no-cache")
    try:
        rr_share = _run(rr, replicas, tokenizer, seed=2)
    finally:
        rr.stop()
    print(f"prefix tokens hit: kv-aware {kv_share:.2f}, round-robin {rr_share:.2f}")
    assert kv_share >= 0.8, (kv_share, decisions)
    assert rr_share < 0.6, rr_share  # about 1/3: a family's next request is on another replica twice in three
    assert decisions["octavo_gateway:routing_decisions_total[reason=kv_hit]"] >= 0.8 * FAMILIES * (ROUNDS - 1)
