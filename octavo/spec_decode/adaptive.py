"""How many tokens to propose: speculation pays while a verified step emits
enough tokens to cover what it costs over a plain step, and that changes with the
batch size (a step of 32 requests x (k + 1) tokens is no longer one weight
read: its matmuls grow with the rows), the acceptance rate (the text), the
proposer (a draft model's k forwards, or almost nothing for n-gram) and k
itself: each further proposal costs a draft forward and a verified row, and is
accepted less often than the one before it (the shipped draft at batch 1: k=2
1.11x, k=3 1.06x).

So the choice is measured, per batch-size bucket (1, 2-3, 4-7, 8-15, ...),
among k = 0 (plain decoding) .. num_speculative_tokens: the cost per emitted
token of each k's steps, as the median cost of its last ``window`` steps over
the mean tokens they emitted. Not a mean of each step's cost per token: one-off
steps decided that (a size's first step runs eagerly, the next records its
kernel tape at ~10 plain steps' cost, and speculation's first steps at batch
1 hold several such, so octavo-mini + its draft measured speculation dearer
and stopped it for good, where it pays 1.05-1.2x); and the first
``settle_steps`` steps of each k are not measured at all. A bucket first measures
each k in turn, the most proposals first and plain decoding last, then takes the
cheapest; every ``probe_every`` steps it runs another k (each in turn) for
``probe_steps`` steps again, so a change of text or load is noticed: 1% of the
steps, which bounds what probing costs where speculation loses (a draft model at
batch 32: a step costs ~2.3x per token, so ~1.3%). A step whose k differs from
the step before it (it verifies proposals of one k and proposes another) is not
counted: it is part of each. Torch-free; the caller passes the times (the model
runner: CPU time of its process, steadier than wall time on a shared machine).
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
    """One k's steps in a bucket: their recent median cost (which one-off steps do not move) and the tokens
    each request emitted in each of them. The first ``settle`` steps are not measured."""

    def __init__(self, window: int, settle: int) -> None:
        self.seconds = _Recent(window)
        self.emitted: deque[list[int]] = deque(maxlen=window)
        self.settle = settle
        self.count = 0  # steps measured

    def add(self, seconds: float, emitted: list[int]) -> None:
        if self.settle:
            self.settle -= 1
            return
        self.seconds.add(seconds)
        self.emitted.append(emitted)
        self.count += 1


@dataclass
class _Bucket:
    modes: dict[int, _Mode]  # by proposals per request (0: plain decoding)
    steps: int = 0  # decisions taken in this bucket
    probe_left: int = 0  # steps of ``probe_k`` still to run
    probe_k: int = 0
    probes: int = 0


class SpeculationGovernor:
    """Decides per step how many tokens each request proposes (0: none); learns from each step's cost."""

    def __init__(
        self,
        num_speculative_tokens: int,
        adaptive: bool = True,
        max_batch_size: Optional[int] = None,
        warmup_steps: int = 8,
        probe_every: int = 400,
        probe_steps: int = 4,
        window: int = 16,
        settle_steps: int = 8,
    ) -> None:
        self.max_k = num_speculative_tokens
        # Measured in this order at first; on equal costs the earlier (more tokens a step) wins.
        self.ks = list(range(num_speculative_tokens, -1, -1))
        self.adaptive = adaptive
        self.max_batch_size = max_batch_size
        self.warmup_steps = warmup_steps
        self.probe_every = probe_every
        self.probe_steps = probe_steps
        self.window = window
        self.settle_steps = settle_steps
        self._buckets: dict[int, _Bucket] = {}
        self._overhead = _Recent(window)  # seconds per step spent outside the model runner

    def proposals(self, batch_size: int) -> int:
        """Tokens each request should propose in a step where ``batch_size`` requests decoded (0: none)."""
        if batch_size < 1 or (self.max_batch_size is not None and batch_size > self.max_batch_size):
            return 0
        if not self.adaptive:
            return self.max_k
        b = self._bucket(batch_size)
        b.steps += 1
        for k in self.ks:
            if b.modes[k].count < self.warmup_steps:
                return k
        best = self._cheapest(b)
        if b.probe_left:
            b.probe_left -= 1
            return b.probe_k
        if b.steps % self.probe_every == 0:
            others = [k for k in self.ks if k != best]
            b.probe_k = others[b.probes % len(others)]
            b.probes += 1
            b.probe_left = self.probe_steps
        return best

    def record(self, emitted: list[int], seconds: float, verified: int, proposed: int) -> None:
        """One step's result: ``emitted[i]`` tokens for decoding request i in ``seconds`` of the model
        runner, having verified the ``verified`` proposals per request chosen the step before and proposed
        ``proposed``."""
        if sum(emitted) < 1 or verified != proposed:
            return
        b = self._bucket(len(emitted))
        b.modes[proposed].add(seconds + (self._overhead.value or 0.0), emitted)

    def record_overhead(self, seconds: float) -> None:
        """Time between two steps spent outside the runner (scheduling, output
        processing): a cost per step, which speculation spreads over more tokens."""
        self._overhead.add(seconds)

    def best_proposals(self, batch_size: int) -> Optional[int]:
        """The proposals per request the measurements favour for ``batch_size`` (None: not all measured yet)."""
        b = self._buckets.get(batch_size.bit_length())
        if b is None or any(not m.emitted for m in b.modes.values()):
            return None
        return self._cheapest(b)

    def _bucket(self, batch_size: int) -> _Bucket:
        bucket = batch_size.bit_length()
        if bucket not in self._buckets:
            self._buckets[bucket] = _Bucket({k: _Mode(self.window, self.settle_steps) for k in self.ks})
        return self._buckets[bucket]

    def _cheapest(self, b: _Bucket) -> int:
        return min(self.ks, key=lambda k: self._per_token(b, k))

    @staticmethod
    def _per_token(b: _Bucket, k: int) -> float:
        """Seconds per emitted token of k proposals per request: the median cost of k's steps over their
        mean requests, each request emitting what it emitted in the recent steps of k or more proposals, as
        far as k proposals reach: a request that accepted j of them would have emitted 1 + min(j, k). So each
        smaller k is judged on the text the chosen one decodes now, not on the text of its own last probe
        (acceptance changes from one file to the next several times over: k=2's steps emitted 1.77 tokens
        on one held-out file, 2.2 on average)."""
        mode = b.modes[k]
        requests = sum(len(e) for e in mode.emitted) / len(mode.emitted)
        seen = [min(n, k + 1) for m in b.modes if m >= k for e in b.modes[m].emitted for n in e]
        return mode.seconds.value / (requests * sum(seen) / len(seen))
