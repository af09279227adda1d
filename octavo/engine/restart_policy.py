"""When the front restarts a dead engine process, and when it gives up.

A crash can be a one-off (a kernel OOM kill, a bad driver moment) or
permanent (a broken model, a GPU gone bad). Restarting with exponential
back-off rides out the first kind; counting failures in a sliding window
turns the second kind into a non-zero exit, so that an orchestrator
(systemd, Kubernetes) restarts or reschedules the whole server instead of
a front answering 503 forever. ``max_restarts=0`` gives vLLM's behaviour:
exit as soon as the engine dies.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RestartPolicy:
    max_restarts: int = 3  # within ``window_s``; one more failure there gives up
    window_s: float = 60.0
    first_delay_s: float = 0.5  # doubles with each failure still in the window
    max_delay_s: float = 30.0
    _failures: deque[float] = field(default_factory=deque, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"engine_max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"engine_restart_window_s must be > 0, got {self.window_s}")
        if self.first_delay_s < 0 or self.max_delay_s < self.first_delay_s:
            raise ValueError("restart delays must satisfy 0 <= first_delay_s <= max_delay_s")

    def on_failure(self, now: float) -> Optional[float]:
        """Record a failure at ``now`` (monotonic seconds); the delay before
        the next start, or None to give up."""
        self._failures.append(now)
        while self._failures and self._failures[0] < now - self.window_s:
            self._failures.popleft()
        recent = len(self._failures)
        if recent > self.max_restarts:
            return None
        return min(self.first_delay_s * 2 ** (recent - 1), self.max_delay_s)

    @property
    def recent_failures(self) -> int:
        return len(self._failures)
