"""Where an Octavo run's time goes, step by step: each engine step's wall time
and what it ran, grouped by kind (decode only, or with prompt tokens) and by
rows (the requests in the step, in the linear table's buckets).

    python -m benchmarks.throughput --num-prompts 128 --peers octavo --step-split

Each step is timed around ``engine.step()``; what it ran is read from the
scheduler's output for it (the engine runs one step at a time on one rank).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

from octavo.core.outputs import SchedulerOutput
from octavo.quant.linear_table import bucket


class StepSplit:
    """Steps recorded while ``recording(engine)`` is open."""

    def __init__(self) -> None:
        self._scheduled: list[SchedulerOutput] = []
        self._seconds: list[float] = []

    @contextmanager
    def recording(self, engine: Any) -> Iterator[None]:
        scheduler = engine.scheduler
        schedule, step = scheduler.schedule, engine.step

        def scheduled(*args: Any, **kwargs: Any) -> SchedulerOutput:
            out = schedule(*args, **kwargs)
            self._scheduled.append(out)
            return out

        def timed_step() -> Any:
            start = time.perf_counter()
            try:
                return step()
            finally:
                self._seconds.append(time.perf_counter() - start)

        scheduler.schedule, engine.step = scheduled, timed_step
        try:
            yield
        finally:
            del scheduler.schedule, engine.step  # the instance attributes: back to the class's methods

    def rows(self) -> list[dict[str, object]]:
        """One row per (kind, rows bucket): steps, seconds, share of the time, tokens."""
        groups: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0])
        for out, seconds in zip(self._scheduled, self._seconds):
            if out.is_empty:
                continue
            requests, tokens = len(out.scheduled), out.total_num_tokens
            group = groups[("with prompt" if tokens > requests else "decode", bucket(requests))]
            group[0] += 1
            group[1] += seconds
            group[2] += tokens
        total = sum(self._seconds) or 1.0
        return [{"kind": kind, "rows_up_to": rows, "steps": int(n), "seconds": s, "share": s / total,
                 "ms_per_step": s / n * 1e3, "tokens": int(t)}
                for (kind, rows), (n, s, t) in sorted(groups.items())]
