"""``--step-record PATH``: one JSON line per engine step, appended as the
engine process runs, so a served engine's steps can be fitted one by one
(``octavo simulate calibrate --served-steps``) rather than from what clients
measure end to end.

A line holds what the step was given and how long it took:

    {"start": 1234.5678, "seconds": 0.0041, "after_idle": false,
     "scheduled": [[num_tokens, start_pos, sample], ...]}

``start`` is ``time.monotonic()`` as the step began (one clock for every
process of the machine, so a reader can pick the steps of a time window);
``seconds`` the whole ``LLMEngine.step()``; ``after_idle`` whether the loop
waited for a request before it (the time from one start to the next is then
not one step's). ``scheduled`` has a triple per scheduled request: tokens
computed, the position of the first, and whether it samples. Line-buffered:
a reader sees every finished step. Writing a line costs ~20 us, against steps
of milliseconds, and only when asked for.
"""
from __future__ import annotations

import json
from typing import TextIO

from octavo.core.outputs import SchedulerOutput


class StepRecord:
    def __init__(self, path: str) -> None:
        self._file: TextIO = open(path, "a", buffering=1)
        self._scheduled: list[list[int]] = []

    def scheduled(self, sched_out: SchedulerOutput) -> None:
        """The step about to run (``LLMEngine.on_step_scheduled``)."""
        self._scheduled = [[s.num_tokens, s.start_pos, int(s.sample)] for s in sched_out.scheduled]

    def ran(self, start: float, seconds: float, after_idle: bool) -> None:
        """The step scheduled last has run: append its line (none for a step that scheduled nothing)."""
        if self._scheduled:
            line = {"start": round(start, 6), "seconds": round(seconds, 6), "after_idle": after_idle,
                    "scheduled": self._scheduled}
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._scheduled = []

