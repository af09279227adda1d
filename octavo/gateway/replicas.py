"""The replicas behind the gateway: their load, their circuit breaker, and the set of them.

Breaker states: CLOSED (routable), OPEN (skipped; entered after
``failure_threshold`` consecutive failures), HALF_OPEN (the cool-down has
passed: the next health probe decides, success closes the breaker and a
failure opens it again for another cool-down). Probes rather than a trial
client request: a replica that just came back should not cost a client a
failed request, and the probe runs every ``probe_interval_s`` anyway.
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from octavo.gateway.config import BreakerConfig
from octavo.gateway.replica_url import normalize_url

logger = logging.getLogger(__name__)


class BreakerState(enum.IntEnum):
    # Values are what /metrics exports per replica.
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass
class Breaker:
    config: BreakerConfig
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    replica: str = ""  # whose breaker, for the log lines of its transitions

    def record_success(self) -> None:
        if self.state != BreakerState.CLOSED:
            logger.info("replica %s: breaker closed (it answers again)", self.replica)
        self.failures = 0
        self.state = BreakerState.CLOSED

    def record_failure(self, now: Optional[float] = None) -> None:
        self.failures += 1
        if self.state == BreakerState.HALF_OPEN or self.failures >= self.config.failure_threshold:
            if self.state != BreakerState.OPEN:
                logger.warning("replica %s: breaker opened after %d failures; no requests for %g s",
                               self.replica, self.failures, self.config.cooldown_s)
            self.state = BreakerState.OPEN
            self.opened_at = time.monotonic() if now is None else now

    def allows_requests(self) -> bool:
        return self.state == BreakerState.CLOSED

    def due_for_trial(self, now: Optional[float] = None) -> bool:
        """An open breaker whose cool-down is over turns half-open: the next probe is its trial."""
        now = time.monotonic() if now is None else now
        if self.state == BreakerState.OPEN and now - self.opened_at >= self.config.cooldown_s:
            self.state = BreakerState.HALF_OPEN
        return self.state == BreakerState.HALF_OPEN


@dataclass
class Replica:
    url: str
    breaker: Breaker
    # From the replica's /metrics, scraped by the health loop.
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    healthy: bool = True
    # The gateway's own count of requests it has open on this replica, and
    # that count when the metrics were scraped: requests sent since then are
    # not in the scraped queue yet.
    in_flight: int = 0
    in_flight_at_scrape: int = 0

    @property
    def load(self) -> int:
        scraped = self.running + self.waiting
        return max(scraped + self.in_flight - self.in_flight_at_scrape, self.in_flight)

    @property
    def routable(self) -> bool:
        return self.breaker.allows_requests()


@dataclass
class ReplicaSet:
    breaker_config: BreakerConfig
    _replicas: dict[str, Replica] = field(default_factory=dict)

    def add(self, url: str) -> Replica:
        url = normalize_url(url)
        if url not in self._replicas:
            self._replicas[url] = Replica(url, Breaker(self.breaker_config, replica=url))
        return self._replicas[url]

    def remove(self, url: str) -> bool:
        return self._replicas.pop(normalize_url(url), None) is not None

    def get(self, url: str) -> Optional[Replica]:
        return self._replicas.get(normalize_url(url))

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def routable(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.routable]
