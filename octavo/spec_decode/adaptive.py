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
plain decoding and one proposal in turn, ``probe_steps`` steps at a time (the
proposal first, round after round, until each has ``warmup_steps``), and a
larger k only while the largest measured so far is the cheapest: each further
proposal is accepted less often than the one before it, so where one does not
pay more do not either, and measuring them would cost the dearest steps of all
(octavo-mini's draft at batch 32: a k=3 step costs ~3.7 plain ones). Then it takes
the cheapest (speculating must be ``margin`` cheaper than plain decoding) and
keeps it until a probe beats it: now and then it runs another k
(each in turn) for ``probe_steps`` steps, measured afresh, and switches when
that k costs less than the chosen one's own recent steps. The two are measured
side by side, so neither a change of load nor of context length (the chosen
k's cost grows as the sequences grow, a k measured long ago does not) moves
the choice by itself: comparing the chosen k's recent steps with other ks' old
ones switched a batch of 32 to speculating where it lost (0.71x of plain
decoding).

A probe costs what its steps cost beyond the chosen k's price for the tokens
they emitted, and where speculation loses that is more than its steps: a
draft model that did not run while the choice was 0 first catches up on every
token decoded since (at batch 32 ~30-60 ms, a dozen plain steps or more). So
probes are spaced by what they cost: the next one waits ``probe_every`` steps
and until everything the bucket spent off its choice (the first measurements
of each k included) is within ``probe_budget`` of all it spent. A probe that
costs little (batch 1, where speculation pays) comes about every
``probe_every`` steps; one that costs much comes rarely. The first choice rests on
a few steps of each k, and at batch 1 it took plain decoding in one quiet run of
the shipped draft on held-out text where speculating pays 1.35x, so a cheap probe
comes soon enough (100 steps) to undo such a choice within a request's output,
the budget alone keeping dear ones rare. A step whose k differs from the step
before it (it verifies proposals of one k and proposes another) is not
measured: it is part of each; it counts as spent off the choice.

A bucket measures and probes only within a run of its own steps (``steady_steps`` in a row): a batch that
ramps up through its prompts' prefill steps and down as requests finish passes through each smaller bucket
for a step or two, where a measurement can neither finish (a step verifying another bucket's proposals is
not measured) nor be worth it: a k > 0 there makes an idle draft catch up on whole sequences (octavo-mini's
draft at batch 32: ~0.1 s a run of 128 steps, ~0.8 ms a step, where the batch's own bucket had chosen plain
decoding). Such a step takes its bucket's choice, or while it has none the nearest bucket's (a larger one
on a tie: more requests propose fewer tokens), or 0 while none has chosen. Torch-free;
the caller passes the times (the model runner: CPU time of its process,
steadier than wall time on a shared machine).
"""
from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
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
    """One k's steps in a bucket: their recent median cost (which one-off steps do not move) and how many
    requests emitted how many tokens in each of them, with the sum of those counts over the window kept as
    steps come and go: judging a k reads the counts of every larger k too, which summed request by request
    took ~0.3 ms at batch 32, an eighth of a plain step, each time it was asked. The first ``settle`` steps
    are not measured."""

    def __init__(self, window: int, settle: int) -> None:
        self.seconds = _Recent(window)
        self.emitted: deque[Counter[int]] = deque()  # per step: tokens emitted -> requests
        self.tokens: Counter[int] = Counter()  # ... summed over the window
        self.requests = 0  # requests in the window's steps
        self.window = window
        self.settle = settle
        self.count = 0  # steps measured

    def add(self, seconds: float, emitted: list[int]) -> None:
        if self.settle:
            self.settle -= 1
            return
        self.seconds.add(seconds)
        step = Counter(emitted)
        self.emitted.append(step)
        self.tokens.update(step)
        self.requests += len(emitted)
        if len(self.emitted) > self.window:
            old = self.emitted.popleft()
            self.tokens.subtract(old)
            self.requests -= sum(old.values())
        self.count += 1


@dataclass
class _Bucket:
    modes: dict[int, _Mode]  # by proposals per request (0: plain decoding)
    choice: Optional[int] = None  # the k chosen, once every k was measured
    steps: int = 0  # decisions taken in this bucket
    probe_left: int = 0  # steps of ``probe_k`` still to run
    probe_k: int = 0
    reach: int = 1  # the most proposals measured before the first choice: one more while it is the cheapest
    probes: int = 0
    last_probe: int = 0  # ``steps`` when the last probe began
    spent: float = 0.0  # seconds of all its measurable steps
    off_seconds: float = 0.0  # ... of those off the choice (measuring other ks, and switching)
    off_tokens: int = 0  # tokens those emitted
    # Seconds spent outside the model runner after a step, by the k it proposed: output processing and
    # scheduling grow with the tokens a step emits and the proposals it sends, so speculation pays more
    # of it per step than plain decoding (octavo-mini at batch 32: ~0.7 ms after a ~2.4 ms plain step,
    # ~0.8 ms after a speculating one).
    overhead: dict[int, _Recent] = field(default_factory=dict)


class SpeculationGovernor:
    """Decides per step how many tokens each request proposes (0: none); learns from each step's cost."""

    def __init__(
        self,
        num_speculative_tokens: int,
        adaptive: bool = True,
        max_batch_size: Optional[int] = None,
        warmup_steps: int = 8,
        probe_every: int = 100,
        probe_steps: int = 6,
        window: int = 16,
        settle_steps: int = 8,
        probe_budget: float = 0.01,
        margin: float = 0.05,
        steady_steps: int = 8,
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
        self.probe_budget = probe_budget
        self.margin = margin
        self.steady_steps = steady_steps
        self._buckets: dict[int, _Bucket] = {}
        self._last_bucket = 0  # the bucket of the previous step (0: none, or a batch past max_batch_size)
        self._run = 0  # ... and the steps in a row it has had

    def proposals(self, batch_size: int) -> int:
        """Tokens each request should propose in a step where ``batch_size`` requests decoded (0: none)."""
        if batch_size < 1 or (self.max_batch_size is not None and batch_size > self.max_batch_size):
            self._last_bucket = 0
            return 0
        if not self.adaptive:
            return self.max_k
        bucket = batch_size.bit_length()
        self._run = self._run + 1 if bucket == self._last_bucket else 1
        self._last_bucket = bucket
        b = self._bucket(batch_size)
        b.steps += 1
        choice = self._choose(b)
        if self._run <= self.steady_steps:
            return self._borrowed(bucket) if choice is None else choice
        if choice is None:
            return self._measure_next(b)
        if b.probe_left:
            b.probe_left -= 1
            if not b.probe_left and b.modes[b.probe_k].emitted:
                # The probe's steps against the chosen k's recent ones: measured side by side.
                b.choice = self._cheapest(b, [b.choice, b.probe_k])
            return b.probe_k if b.probe_left else b.choice
        since = b.steps - b.last_probe
        # The budget is read every ``window`` steps: reading it costs ~10 us, a step at batch 32 ~2.4 ms.
        if (since >= self.probe_every and since % self.window == 0
                and self._probing_cost(b) <= self.probe_budget * b.spent):
            others = [k for k in self.ks if k != b.choice]
            b.probe_k = others[b.probes % len(others)]
            b.probes += 1
            b.last_probe = b.steps
            # Its steps are measured afresh: old ones were taken on other text, contexts and load.
            b.modes[b.probe_k] = _Mode(self.window, settle=0)
            b.probe_left = self.probe_steps
            return b.probe_k
        return b.choice

    def record(self, emitted: list[int], seconds: float, verified: int, proposed: int) -> None:
        """One step's result: ``emitted[i]`` tokens for decoding request i in ``seconds`` of the model
        runner, having verified the ``verified`` proposals per request chosen the step before and proposed
        ``proposed``."""
        if sum(emitted) < 1:
            return
        b = self._bucket(len(emitted))
        overhead = b.overhead.get(proposed)
        cost = seconds + (overhead.value if overhead is not None else 0.0)
        b.spent += cost
        if verified != b.choice or proposed != b.choice:
            b.off_seconds += cost
            b.off_tokens += sum(emitted)
        if verified == proposed:
            b.modes[proposed].add(cost, emitted)

    def record_overhead(self, seconds: float, batch_size: int, proposed: int) -> None:
        """Time between two steps spent outside the runner (scheduling, output processing), after a step
        where ``batch_size`` requests decoded and proposed ``proposed`` tokens each: a cost of each step of
        that k, which speculation spreads over more tokens."""
        if batch_size >= 1:
            b = self._bucket(batch_size)
            b.overhead.setdefault(proposed, _Recent(self.window)).add(seconds)

    def best_proposals(self, batch_size: int) -> Optional[int]:
        """The proposals per request chosen for ``batch_size`` (None: not all measured yet)."""
        b = self._buckets.get(batch_size.bit_length())
        return None if b is None else self._choose(b)

    def _choose(self, b: _Bucket) -> Optional[int]:
        """The bucket's choice, taken once every k within reach was measured and the largest of them did not
        win (None before)."""
        if b.choice is not None:
            return b.choice
        measured = [k for k in self.ks if k <= b.reach]
        if all(b.modes[k].count >= self.warmup_steps for k in measured):
            best = self._cheapest(b, measured)
            if best == b.reach < self.max_k:
                b.reach += 1
            else:
                b.choice = best
                b.probe_left, b.last_probe = 0, b.steps
        return b.choice

    def _borrowed(self, bucket: int) -> int:
        """The choice of the nearest bucket that has one (the larger on a tie), 0 when none has."""
        chosen = [n for n, b in self._buckets.items() if b.choice is not None]
        if not chosen:
            return 0
        return self._buckets[min(chosen, key=lambda n: (abs(n - bucket), -n))].choice

    def _measure_next(self, b: _Bucket) -> int:
        """Before the first choice: the ks within reach still short of measurements, in turn, ``probe_steps``
        steps each, so that they all share the text, the contexts and the load of the same minutes (measured
        one after the other, k=1 on a text the draft copied well and k=0 on one it did not, k=1 won at batch
        32 where it cost 5-10% more than plain decoding)."""
        pending = [k for k in self.ks if k <= b.reach and b.modes[k].count < self.warmup_steps]
        if not b.probe_left or b.probe_k not in pending:
            later = [k for k in pending if k < b.probe_k]
            b.probe_k = (later or pending)[0]
            b.probe_left = self.probe_steps
        b.probe_left -= 1
        return b.probe_k

    def _bucket(self, batch_size: int) -> _Bucket:
        bucket = batch_size.bit_length()
        if bucket not in self._buckets:
            self._buckets[bucket] = _Bucket({k: _Mode(self.window, self.settle_steps) for k in self.ks})
        return self._buckets[bucket]

    def _cheapest(self, b: _Bucket, ks: list[int]) -> int:
        """Speculating must cost ``margin`` less per token than plain decoding: its steps do not show all it
        costs (the draft's share of prompt steps, its catch-up after a switch, proposals the scheduler drops),
        and at batch 32 the shipped draft's k=1 measured level with plain decoding where it was 5-8% dearer."""
        return min(ks, key=lambda k: self._per_token(b, k) * (1 + self.margin if k else 1))

    def _probing_cost(self, b: _Bucket) -> float:
        """Seconds the bucket spent off its choice beyond what the choice would have cost for the same
        tokens."""
        return b.off_seconds - b.off_tokens * self._per_token(b, b.choice)

    @staticmethod
    def _per_token(b: _Bucket, k: int) -> float:
        """Seconds per emitted token of k proposals per request: the median cost of k's steps over their
        mean requests, each request emitting what it emitted in the recent steps of k or more proposals, as
        far as k proposals reach: a request that accepted j of them would have emitted 1 + min(j, k). So each
        smaller k is judged on the text the chosen one decodes now, not on the text of its own last probe
        (acceptance changes from one file to the next several times over: k=2's steps emitted 1.77 tokens
        on one held-out file, 2.2 on average)."""
        mode = b.modes[k]
        requests = mode.requests / len(mode.emitted)
        seen: Counter[int] = Counter()
        for m in b.modes:
            if m >= k:
                seen.update(b.modes[m].tokens)
        tokens = sum(min(n, k + 1) * c for n, c in seen.items()) / sum(seen.values())
        return mode.seconds.value / (requests * tokens)
