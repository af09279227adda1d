"""Load shedding by priority: near capacity, new low-priority requests are
refused so the high-priority ones find room.

Above ``kv_usage`` (the engine's KV blocks in use, 0..1) or with
``waiting`` requests or more in the engine's queue, a new request whose
``priority`` value is ``min_priority`` or more (lower values run first, as in
the engine) is answered 503 with Retry-After; more urgent requests are always
admitted. Refusing rather than holding the request: a held request ties up a
connection and is invisible to the engine's priority ordering, while a 503
before any byte lets the gateway retry it on another replica at once and
tells a client when to come back. Requests already running are the engine's
business: when the pool runs out it preempts the least urgent first
(octavo/core/scheduler.py), so low-priority work is also the first stopped.

The engine's numbers reach the server every 0.1 s (octavo/engine/core_process.py),
so a burst can overshoot a threshold by what arrives in that time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from octavo.engine.stats import EngineStats
from octavo.openai.errors import APIError


@dataclass
class ShedConfig:
    shed_kv_usage: Optional[float] = field(default=None, metadata={
        "help": "KV cache usage (0..1) at or above which new requests of priority >= --shed-min-priority "
                "get 503 (e.g. 0.9); default: never"})
    shed_waiting: Optional[int] = field(default=None, metadata={
        "help": "engine queue length at or above which new requests of priority >= --shed-min-priority "
                "get 503; default: never"})
    shed_min_priority: int = field(default=1, metadata={
        "help": "requests with this priority value or more (less urgent) are the ones shed"})

    def __post_init__(self) -> None:
        if self.shed_kv_usage is not None and not (0.0 < self.shed_kv_usage <= 1.0):
            raise ValueError(f"shed_kv_usage must be in (0, 1], got {self.shed_kv_usage}")
        if self.shed_waiting is not None and self.shed_waiting < 0:
            raise ValueError(f"shed_waiting must be >= 0, got {self.shed_waiting}")


def check_shedding(config: ShedConfig, stats: EngineStats, priority: int, waiting_now: int = 0) -> None:
    """Raise the 503 when ``priority`` is sheddable and the engine is past a threshold. ``waiting_now``:
    the requests the front holds beyond the engine's batch at this moment; the engine's stats are a
    snapshot up to a step (or, under load, seconds) old, and a burst arrives between two of them."""
    if priority < config.shed_min_priority:
        return
    reason = None
    waiting = max(stats.num_waiting, waiting_now)
    if config.shed_kv_usage is not None and stats.kv_cache_usage >= config.shed_kv_usage:
        reason = f"KV cache {100 * stats.kv_cache_usage:.0f}% used (limit {100 * config.shed_kv_usage:.0f}%)"
    elif config.shed_waiting is not None and waiting >= config.shed_waiting:
        reason = f"{waiting} requests queued (limit {config.shed_waiting})"
    if reason is not None:
        raise APIError(
            503, f"the server is near capacity ({reason}) and sheds requests of priority >= "
                 f"{config.shed_min_priority}; retry later", code="shed_low_priority",
            headers={"Retry-After": "1"},
        )
