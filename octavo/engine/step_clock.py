"""When the engine process's current step started, and what it holds:
shared memory the front reads to notice a step that never returns.

A hung step (a collective waiting on a rank that will never answer, a
kernel that never finishes) leaves the process alive and silent: its
sentinel never fires and it sends nothing, so every request would wait
forever. The engine writes four numbers around each step; the front's
watchdog (``AsyncEngineClient``) reads them and restarts an engine whose
step runs past ``--engine-step-timeout``. Shared memory rather than a
message: the watchdog must work when the engine process cannot run Python
at all, and writing four doubles costs the step nothing measurable.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Optional

_STARTED, _NUM_REQUESTS, _NUM_TOKENS, _LONGEST = range(4)


@dataclass
class StepReport:
    """A step that has run too long, as the engine last described it."""

    running_s: float
    num_requests: int
    num_tokens: int
    longest_before_s: float  # the longest step that did return


class StepClock:
    """Made by the front before the process starts; the same object (its
    shared array) reaches the engine process as a ``Process`` argument."""

    def __init__(self, ctx: BaseContext) -> None:
        # Unlocked: one writer (the engine's loop), and 8-byte aligned doubles are never read torn.
        self._values: Any = ctx.RawArray("d", 4)

    # ---- the engine's side --------------------------------------------

    def start(self) -> None:
        self._values[_NUM_REQUESTS] = self._values[_NUM_TOKENS] = 0
        self._values[_STARTED] = time.monotonic()

    def scheduled(self, num_requests: int, num_tokens: int) -> None:
        """What the step runs, once the scheduler has chosen it."""
        self._values[_NUM_REQUESTS] = num_requests
        self._values[_NUM_TOKENS] = num_tokens

    def stop(self) -> None:
        took = time.monotonic() - self._values[_STARTED]
        self._values[_STARTED] = 0.0
        self._values[_LONGEST] = max(self._values[_LONGEST], took)

    # ---- the front's side ---------------------------------------------

    def overdue(self, timeout_s: float) -> Optional[StepReport]:
        """The running step when it has run longer than ``timeout_s`` (monotonic
        clocks are one clock for every process of the machine), else None."""
        started = self._values[_STARTED]
        if not started:
            return None
        running = time.monotonic() - started
        if running <= timeout_s:
            return None
        return StepReport(running, int(self._values[_NUM_REQUESTS]), int(self._values[_NUM_TOKENS]),
                          self._values[_LONGEST])
