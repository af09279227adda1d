"""When to propose: speculation pays while a verified step emits enough
tokens to cover what it costs over a plain step, and that changes with the
batch size (a step of 32 requests x (k + 1) tokens is no longer one weight
read: its matmuls grow with the rows), the acceptance rate (the text) and the
proposer (a draft model's k forwards, or almost nothing for n-gram).

So the choice is measured, per batch-size bucket (1, 2-3, 4-7, 8-15, ...):
the cost per emitted token of steps that verified and proposed, and of
plain steps, each as the median cost of its last ``window`` steps over the
mean tokens they emitted. Not a mean of each step's cost per token: one-off
steps decided that (a size's first step runs eagerly, the next records its
kernel tape at ~10 plain steps' cost, and speculation's first steps at batch
1 hold several such, so octavo-mini + its draft measured speculation dearer
and stopped it for good, where it pays 1.05-1.2x); and the first
``settle_steps`` steps of each mode are not measured at all. A bucket first measures
speculation, then plain decoding, then takes the cheaper; every
``probe_every`` steps it runs the other mode for ``probe_steps`` steps again,
so a change of text or load is noticed: 1% of the steps, which bounds what
probing costs where speculation loses (a draft model at batch 32: a step costs
~2.3x per token, so ~1.3%). A step that switches mode (proposes
without verifying, or verifies without proposing) is not counted: it is half
of each. Torch-free; the caller passes the times (the model runner: CPU
time of its process, steadier than wall time on a shared machine).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Optional


class _Recent:
    """The median of the last ``window`` values added."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def add(self, x: float) -> None:
        self.values.append(x)

    @property
    def value(self) -> Optional[float]:
        return statistics.median(self.values) if self.values else None


class _Mode:
    """One mode's steps in a bucket: their recent median cost per step over the mean tokens they emitted
    (tokens per step average out as throughput does; costs take the median, which one-off steps do not
    move). The first ``settle`` steps are not measured."""

    def __init__(self, window: int, settle: int) -> None:
        self.seconds = _Recent(window)
        self.emitted: deque[int] = deque(maxlen=window)
        self.settle = settle
        self.count = 0  # steps measured

    def add(self, seconds: float, emitted: int) -> None:
        if self.settle:
            self.settle -= 1
            return
        self.seconds.add(seconds)
        self.emitted.append(emitted)
        self.count += 1

    @property
    def value(self) -> Optional[float]:
        """Seconds per emitted token (None: nothing measured yet)."""
        if not self.emitted:
            return None
        return self.seconds.value * len(self.emitted) / sum(self.emitted)


@dataclass
class _Bucket:
    spec: _Mode  # steps that verified and proposed
    plain: _Mode  # ... neither
    steps: int = 0  # decisions taken in this bucket
    probe_left: int = 0  # steps of the other mode still to run


class SpeculationGovernor:
    """Decides per step whether to propose; learns from each step's cost."""

    def __init__(
        self,
        adaptive: bool = True,
        max_batch_size: Optional[int] = None,
        warmup_steps: int = 8,
        probe_every: int = 400,
        probe_steps: int = 4,
        window: int = 16,
        settle_steps: int = 8,
    ) -> None:
        self.adaptive = adaptive
        self.max_batch_size = max_batch_size
        self.warmup_steps = warmup_steps
        self.probe_every = probe_every
        self.probe_steps = probe_steps
        self.window = window
        self.settle_steps = settle_steps
        self._buckets: dict[int, _Bucket] = {}
        self._overhead = _Recent(window)  # seconds per step spent outside the model runner

    def should_propose(self, batch_size: int) -> bool:
        """Whether a step where ``batch_size`` requests decoded should propose."""
        if batch_size < 1 or (self.max_batch_size is not None and batch_size > self.max_batch_size):
            return False
        if not self.adaptive:
            return True
        b = self._bucket(batch_size)
        b.steps += 1
        if b.spec.count < self.warmup_steps:
            return True
        if b.plain.count < self.warmup_steps:
            return False
        best = self._cheaper_is_spec(b)
        if b.probe_left:
            b.probe_left -= 1
            return not best
        if b.steps % self.probe_every == 0:
            b.probe_left = self.probe_steps
        return best

    def record(self, batch_size: int, emitted: int, seconds: float, verified: bool, proposed: bool) -> None:
        """One step's result: ``emitted`` tokens for ``batch_size`` decoding
        requests in ``seconds`` of the model runner."""
        if batch_size < 1 or emitted < 1 or verified != proposed:
            return
        b = self._bucket(batch_size)
        per_step = seconds + (self._overhead.value or 0.0)
        (b.spec if verified else b.plain).add(per_step, emitted)

    def record_overhead(self, seconds: float) -> None:
        """Time between two steps spent outside the runner (scheduling, output
        processing): a cost per step, which speculation spreads over more tokens."""
        self._overhead.add(seconds)

    def speculation_pays(self, batch_size: int) -> Optional[bool]:
        """What the measurements say for ``batch_size`` (None: not measured yet)."""
        b = self._buckets.get(batch_size.bit_length())
        if b is None or b.spec.value is None or b.plain.value is None:
            return None
        return self._cheaper_is_spec(b)

    def _bucket(self, batch_size: int) -> _Bucket:
        bucket = batch_size.bit_length()
        if bucket not in self._buckets:
            self._buckets[bucket] = _Bucket(*(_Mode(self.window, self.settle_steps) for _ in range(2)))
        return self._buckets[bucket]

    @staticmethod
    def _cheaper_is_spec(b: _Bucket) -> bool:
        return b.spec.value <= b.plain.value
