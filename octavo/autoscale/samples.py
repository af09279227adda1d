"""One observation of the fleet: what every policy reads, whatever produced it
(Prometheus, the replicas' /metrics, or the capacity simulator)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class MetricsSample:
    """The fleet at ``time`` (seconds on the caller's clock: wall or simulated).

    ``replicas`` is how many replicas the values were measured on (ready ones);
    ``request_rate`` is arrivals per second at the front (the gateway, or the
    sum over replicas); ``waiting`` and ``running`` are request counts summed
    over the replicas (``waiting`` includes requests queued at the gateway for
    want of a replica, which is what wakes a fleet scaled to zero);
    ``kv_usage`` is the mean KV cache usage (0..1) over the replicas;
    ``ttft_p99`` is the p99 time to first token in seconds over the recent
    past, None when no request started in it."""

    time: float
    replicas: int
    request_rate: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    ttft_p99: Optional[float] = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.time):
            raise ValueError(f"time must be finite, got {self.time}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        for name in ("request_rate", "waiting", "running"):
            value = getattr(self, name)
            if not (value >= 0):  # also refuses NaN
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not (0.0 <= self.kv_usage <= 1.0):
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if self.ttft_p99 is not None and not (self.ttft_p99 >= 0):
            raise ValueError(f"ttft_p99 must be >= 0, got {self.ttft_p99}")

    @property
    def idle(self) -> bool:
        return self.request_rate == 0 and self.waiting == 0 and self.running == 0
