"""How fast a served engine got through its work, moment by moment, as its
step record showed it: the slow stretches of a real server replayed in the
simulator as they came, in runs, rather than as a stretch drawn afresh for
every step.

On a shared machine a served engine's slow steps come in runs: the front's
bursts of work, other processes holding the cores for tens or hundreds of
milliseconds. In a validation on 2 cores at load 8-10 the log residuals of
the served steps about the fitted terms had a lag-1 autocorrelation of
0.42-0.58 (0.2 still 50 steps apart), and steps slower than e times their
prediction came in runs of 2.7 on average (up to 43) where independent draws
would give 1.1-1.5. A run of slow steps holds up every request in flight at
once, and a queue builds behind it: that is what a real server's p99s are
made of, and what independent per-step stretches average away.

The tape is the calibration's served steps laid end to end: each one's
seconds and the seconds the fitted terms predict for its work. Over a step
the engine got through predicted work at the rate predicted / seconds. A
simulated step of predicted work ``w`` starting at tape time ``t`` lasts
until the tape has got through ``w`` from ``t``: inside a recorded stall it
crawls at the stall's rate, and a step that starts just before one runs into
it. Time on the tape is time on the simulated clock (from an offset drawn per
replica, wrapping round at its end), so a stall lasts as long in the
simulation as it did on the machine however long the simulated steps are.
Its total time is the recorded steps' total, so the simulated engine gets
through work at the calibration's mean rate, stalls included.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class SpeedTape:
    """``seconds[i]``: how long the i-th recorded served step took; ``work[i]``: what the fitted terms predict
    for it (seconds). Both positive, in the order the steps ran."""

    seconds: list[float]
    work: list[float]

    def __post_init__(self) -> None:
        if len(self.seconds) != len(self.work) or not self.seconds:
            raise ValueError(f"speed_tape: seconds and work must be non-empty and of one length, got "
                             f"{len(self.seconds)} and {len(self.work)}")
        if not all(s > 0 and w > 0 and np.isfinite(s) and np.isfinite(w) for s, w in zip(self.seconds, self.work)):
            raise ValueError("speed_tape: every step's seconds and work must be finite and > 0")
        # Tape time and work got through at each step's start, and at the end (not fields: not saved).
        self._time = [0.0, *itertools.accumulate(self.seconds)]
        self._done = [0.0, *itertools.accumulate(self.work)]

    @classmethod
    def of_steps(cls, seconds: Sequence[float], predicted: Sequence[float]) -> SpeedTape:
        """From served steps' measured and predicted seconds, in the order they ran (rounded to a microsecond, as
        the record keeps them)."""
        return cls([round(float(s), 6) for s in seconds], [round(float(p), 6) for p in predicted])

    @property
    def length_s(self) -> float:
        return self._time[-1]

    @property
    def mean_rate(self) -> float:
        """Predicted work got through per second over the whole tape (1 for a machine the terms describe)."""
        return self._done[-1] / self._time[-1]

    def lag1_autocorrelation(self) -> float:
        """Of the steps' log slowness (seconds / work): how much each step's tells of the next one's (0 for
        stretches drawn independently)."""
        x = np.log(np.array(self.seconds) / np.array(self.work))
        x = x - x.mean()
        scale = float(np.dot(x, x))
        return float(np.dot(x[:-1], x[1:]) / scale) if scale > 0 else 0.0

    def duration(self, start_s: float, work_s: float) -> float:
        """Seconds from tape time ``start_s`` (any real: the tape wraps round) until ``work_s`` of predicted work
        is got through."""
        if work_s <= 0:
            return 0.0
        phase = start_s % self.length_s
        target = self._done_at(phase) + work_s
        whole, target = divmod(target, self._done[-1])
        end = whole * self.length_s + self._time_at(target)
        return end - phase

    def _done_at(self, t: float) -> float:
        i = min(bisect.bisect_right(self._time, t), len(self.seconds)) - 1
        return self._done[i] + (t - self._time[i]) * self.work[i] / self.seconds[i]

    def _time_at(self, done: float) -> float:
        i = min(bisect.bisect_right(self._done, done), len(self.work)) - 1
        return self._time[i] + (done - self._done[i]) * self.seconds[i] / self.work[i]
