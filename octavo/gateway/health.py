"""Active health: every ``probe_interval_s`` each replica's /health and
/metrics are fetched (one round trip each, concurrently over replicas). The
metrics give least-load its queue lengths and KV usage; the probe result feeds
the replica's breaker, which is how an open breaker closes again."""
from __future__ import annotations

import asyncio
import logging
import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families

from octavo.gateway.replicas import Replica, ReplicaSet

logger = logging.getLogger(__name__)

_SCRAPED = {
    "octavo:num_requests_running": "running",
    "octavo:num_requests_waiting": "waiting",
    "octavo:kv_cache_usage_perc": "kv_usage",
    "octavo:prefix_cache_queries_total": "prefix_queries",
    "octavo:prefix_cache_hits_total": "prefix_hits",
}


def apply_metrics(replica: Replica, text: str) -> None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            attr = _SCRAPED.get(sample.name)
            if attr is not None:
                value = sample.value
                setattr(replica, attr, int(value) if attr in ("running", "waiting") else float(value))


async def probe(client: httpx.AsyncClient, replica: Replica, headers: dict[str, str], timeout_s: float) -> None:
    breaker = replica.breaker
    if not breaker.allows_requests() and not breaker.due_for_trial():
        return  # open and cooling down: leave it alone
    in_flight = replica.in_flight
    try:
        health = await client.get(f"{replica.url}/health", headers=headers, timeout=timeout_s)
        ok = health.status_code == 200
        if ok:
            metrics = await client.get(f"{replica.url}/metrics", headers=headers, timeout=timeout_s)
            if metrics.status_code == 200:
                try:
                    apply_metrics(replica, metrics.text)
                    replica.in_flight_at_scrape = in_flight
                except ValueError:  # not Prometheus text: the replica is up, its load unknown
                    logger.debug("replica %s: unreadable /metrics", replica.url)
    except httpx.HTTPError:
        ok = False
    except Exception:  # noqa: BLE001 - one replica's probe must never end the loop that closes every breaker
        logger.exception("replica %s: probe failed", replica.url)
        ok = False
    replica.healthy = ok
    if ok:
        if not breaker.allows_requests():
            logger.info("replica %s passed its trial probe: breaker closed", replica.url)
        breaker.record_success()
    else:
        breaker.record_failure()


async def probe_loop(
    client: httpx.AsyncClient, replicas: ReplicaSet, headers: dict[str, str], interval_s: float, timeout_s: float
) -> None:
    while True:
        await asyncio.gather(*(probe(client, r, headers, timeout_s) for r in replicas))
        await asyncio.sleep(interval_s)


async def resolve(name: str) -> list[str]:
    """The IPv4/IPv6 addresses of ``name`` (every pod of a headless service)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


async def discovery_loop(
    name: str, port: int, replicas: ReplicaSet, interval_s: float
) -> None:
    """Keeps the replicas discovered through ``name`` equal to its addresses;
    replicas added by hand or on the command line are not touched."""
    owned: set[str] = set()  # the replicas this loop added, and only those it may remove
    while True:
        try:
            addresses = await resolve(name)
        except OSError as exc:
            logger.warning("discovery: cannot resolve %s: %s", name, exc)
        else:
            urls = {f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses}
            for url in urls:
                if replicas.get(url) is None:
                    replicas.add(url)
                    owned.add(url)
            for url in owned - urls:
                replicas.remove(url)
                owned.discard(url)
        await asyncio.sleep(interval_s)
