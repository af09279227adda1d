"""How many tokens to propose: speculation pays while a verified step emits
enough tokens to cover what it costs over a plain step, and that changes with the
batch size (a step of 32 requests x (k + 1) tokens is no longer one weight
read: its matmuls grow with the rows), the acceptance rate (the text), the
proposer (a draft model's k forwards, or almost nothing for n-gram) and k
itself: each further proposal costs a draft forward and a verified row, and is
accepted less often than the one before it (the shipped draft at batch 1: k=2
1.11x, k=3 1.06x).

So the choice is measured, per batch-size bucket (1, 2-3, 4-7, 8-15, ...),
among k = 0 (plain decoding) .. num_speculative_tokens, by the cost per emitted
token of each k: the median cost of its recent steps (in the runner, and outside
it after them) per request, over the tokens a request emits in a step of k. Not a
mean of each step's cost per token: one-off steps decided that (a size's first
step runs eagerly, the next records its kernel tape at ~10 plain steps' cost),
and the first ``settle_steps`` steps of each k are not measured at all. The
tokens of a step of k come from the acceptance the engine observes, position by
position (``_Acceptance``): the chance that proposal i is accepted once the ones
before it were, read from the recent steps of every k that proposed that far. So
each k is judged on the text of now, and a k never measured is predicted: its
first positions' acceptance, and a step cost on the line through plain
decoding's and the largest measured k's.

A bucket first measures plain decoding and one proposal in turn, ``probe_steps``
steps at a time (the proposal first), round after round, until each has
``min_requests`` request-steps (and ``warmup_steps`` steps): at batch 1, 8 steps'
acceptance is the mean of 8 draws, a swing as wide as a good draft's gain, and
the choice between plain decoding and speculation at batch 1 on 8 steps of each
went three ways in three quiet runs of the shipped draft on held-out text
(0.95x, 1.34x, 1.06x of plain decoding, where k=2 pays 1.28-1.39x). Then the
cheapest k, measured or predicted, is chosen if it was measured; if not, it is
measured the same way in turn with the cheapest measured one, and so on. A
larger k is measured only where the prediction says it pays most, or where the
largest measured so far is the cheapest (the line puts speculation's fixed cost
on every proposal): each further proposal is accepted less often than the one
before it and costs more, so where one proposal loses more are predicted to lose
more, and measuring them would cost the dearest steps of all (octavo-mini's
draft at batch 32: a k=3 step costs ~3.7 plain ones). Speculating must be ``margin`` cheaper than plain decoding.

The choice is kept until a probe beats it: now and then it runs the k that the
evidence prices lowest among the others for a few steps (half a first
measurement's request-steps, at least ``probe_steps``), measured afresh, and
switches when that k costs less than the chosen one's own recent steps. The two
are measured side by side, so neither a change of load nor of context length
(the chosen k's cost grows as the sequences grow, a k measured long ago does not)
moves the choice by itself: comparing the chosen k's recent steps with other ks'
old ones switched a batch of 32 to speculating where it lost (0.71x of plain
decoding). A probe is due every ``probe_every`` steps, and sooner when the
evidence changes: a chosen k > 0 observes acceptance every step, and when its
tokens per step moved by more than 4 margins since it was last chosen or
confirmed, the text changed and the best k may have with it; and when the steps
taken off the choice (measuring, probing) cost less than it would have for their
tokens, the choice is likely wrong (plain decoding taken at batch 1 on an unlucky
first measurement). Its cost drifting from other ks' old measurements is no such
evidence (the contexts grew).

A probe costs what its steps cost beyond the chosen k's price for the tokens
they emitted, and where speculation loses that is more than its steps: a
draft model that did not run while the choice was 0 first catches up on every
token decoded since (at batch 32 ~30-60 ms, a dozen plain steps or more). So
probes are spaced by what they cost: a due one waits until everything the
bucket spent off its choice (the first measurements of each k included, less
each k's first ``settle_steps`` steps: their eager runs and tape recordings are
one-off costs, ~1 s of CPU time at batch 1 for the shipped draft's four ks, that
kept every probe out for tens of thousands of steps) is within ``probe_budget``
of all it spent. A probe that costs little (batch 1, where speculation pays)
comes when due; one that costs much comes rarely; and where the choice
speculates (its acceptance observed afresh every step), one whose k that evidence
prices a margin below the choice is expected to gain, and comes when due
whatever the budget. A
step whose k differs from the step before it (it verifies proposals of one k and
proposes another) is not measured: it is part of each; it counts as spent off
the choice.

A bucket measures and probes only within a run of its own steps (``steady_steps`` in a row): a batch that
ramps up through its prompts' prefill steps and down as requests finish passes through each smaller bucket
for a step or two, where a measurement can neither finish (a step verifying another bucket's proposals is
not measured) nor be worth it: a k > 0 there makes an idle draft catch up on whole sequences (octavo-mini's
draft at batch 32: ~0.1 s a run of 128 steps, ~0.8 ms a step, where the batch's own bucket had chosen plain
decoding). Such a step takes its bucket's choice, or while it has none the nearest bucket's (a larger one
on a tie: more requests propose fewer tokens), or 0 while none has chosen. Torch-free;
the caller passes the times (the model runner: CPU time of its process,
steadier than wall time on a shared machine). A settled step costs the governor a few microseconds: a
plain step's tokens are counted without reading them request by request, and the ks are judged every
``window`` steps, not every step.
"""
from __future__ import annotations

import math
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
    """One k's steps in a bucket: their recent median cost in the runner (which one-off steps do not move)
    and the requests that decoded in each. The first ``settle`` steps are not measured."""

    def __init__(self, window: int, settle: int) -> None:
        self.seconds = _Recent(window)
        self.batches: deque[int] = deque()  # requests per step
        self.requests = 0  # ... summed over the window
        self.window = window
        self.settle = settle
        self.count = 0  # steps measured

    def add(self, seconds: float, requests: int) -> None:
        if self.settle:
            self.settle -= 1
            return
        self.seconds.add(seconds)
        self.batches.append(requests)
        self.requests += requests
        if len(self.batches) > self.window:
            self.requests -= self.batches.popleft()
        self.count += 1

    @property
    def per_request(self) -> Optional[float]:
        """The median step's seconds over the mean requests of its steps (None: none measured)."""
        if not self.batches:
            return None
        return self.seconds.value / (self.requests / len(self.batches))


class _Acceptance:
    """What the recent ``window`` speculating steps (of any k) accepted, position by position: how many
    requests reached proposal i (every one for i = 1, those that accepted i - 1 beyond, as far as their k
    went) and how many accepted it, kept as steps come and go from each step's count of requests by tokens
    emitted (not request by request: at batch 32 that took ~0.3 ms, an eighth of a plain step, each time the
    ks were judged). Pooled over the ks, so that a smaller k than the chosen one is judged on the text the
    chosen one decodes now, not on the text of its own last probe (acceptance changes from one file to the
    next several times over: k=2's steps emitted 1.77 tokens on one held-out file, 2.2 on average), and a
    larger one on its first positions' acceptance."""

    def __init__(self, max_k: int, window: int) -> None:
        self.steps: deque[tuple[int, Counter[int]]] = deque()  # (proposals per request, tokens -> requests)
        self.reached = [0] * (max_k + 1)  # by position, 1-based
        self.accepted = [0] * (max_k + 1)
        self.window = window

    def add(self, k: int, emitted: list[int]) -> None:
        step = (k, Counter(emitted))
        self.steps.append(step)
        self._count(step, 1)
        if len(self.steps) > self.window:
            self._count(self.steps.popleft(), -1)

    def _count(self, step: tuple[int, Counter[int]], sign: int) -> None:
        k, emitted = step
        for n, requests in emitted.items():
            # n - 1 proposals accepted: positions 1 .. n reached (up to k), 1 .. n - 1 accepted.
            for i in range(1, min(n, k) + 1):
                self.reached[i] += sign * requests
                if i < n:
                    self.accepted[i] += sign * requests

    def tokens(self, k: int) -> float:
        """Tokens a request emits in a step of k: 1 + the sum over i <= k of the chance that the first i
        proposals are accepted, the product of each position's acceptance given the one before it; a
        position no recent step reached takes the deepest one's that was (1 while none was)."""
        tokens, chance, rate = 1.0, 1.0, 0.0
        for i in range(1, k + 1):
            if self.reached[i]:
                rate = self.accepted[i] / self.reached[i]
            chance *= rate
            tokens += chance
        return tokens


@dataclass
class _Bucket:
    modes: dict[int, _Mode]  # by proposals per request (0: plain decoding)
    acceptance: _Acceptance
    needed: int  # steps each k measures before the first choice: at least ``min_requests`` request-steps
    window: int  # steps a mode's measurement holds (at least ``needed``)
    choice: Optional[int] = None  # the k chosen, once the ks measured were
    steps: int = 0  # decisions taken in this bucket
    probe_left: int = 0  # steps of ``probe_k`` still to run
    probe_k: int = 0
    measuring: list[int] = field(default_factory=lambda: [1, 0])  # the ks measured before the first choice
    turn: int = -1  # ... the one measured now, by its index in ``measuring``
    last_probe: int = 0  # ``steps`` when the last probe began
    tokens: float = 1.0  # a request's tokens per step of the choice when it was last chosen or confirmed
    spent: float = 0.0  # seconds of all its measurable steps
    off_seconds: float = 0.0  # ... of those off the choice (measuring other ks, and switching)
    off_tokens: int = 0  # tokens those emitted
    # The same since the first choice or the last probe's end, and what the earlier ones cost beyond the
    # chosen k's price for their tokens, priced as each probe ended: beside them.
    recent_seconds: float = 0.0
    recent_tokens: int = 0
    off_excess: float = 0.0
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
        min_requests: int = 32,
    ) -> None:
        self.max_k = num_speculative_tokens
        self.ks = list(range(num_speculative_tokens, -1, -1))  # on equal costs the earlier (more tokens) wins
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
        self.min_requests = min_requests
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
        if self._run <= self.steady_steps:
            return self._borrowed(bucket) if b.choice is None else b.choice
        if b.choice is None:
            return self._measure_next(b)
        if b.probe_left:
            b.probe_left -= 1
            if not b.probe_left and b.modes[b.probe_k].batches:
                self._settle(b)
                # The probe's steps against the chosen k's recent ones: measured side by side.
                choice = self._cheapest(b, [b.choice, b.probe_k])
                if choice != b.choice:
                    # What the steps off the old choice saved against it says nothing of the new one.
                    b.choice, b.off_excess = choice, max(b.off_excess, 0.0)
                b.tokens = b.acceptance.tokens(b.choice)
            return b.probe_k if b.probe_left else b.choice
        since = b.steps - b.last_probe
        # Read every ``window`` steps: judging the ks costs ~10-50 us, a step at batch 32 ~2.4 ms.
        if since % b.window or since < b.window:
            return b.choice
        # Due every ``probe_every`` steps, and sooner when the acceptance moved since the choice was last
        # confirmed (a chosen k > 0 observes it every step): the text changed, and with it the best k; or
        # when the steps off the choice cost less than it would have for their tokens: it is likely wrong.
        due = (since >= self.probe_every or b.off_excess < 0
               or abs(b.acceptance.tokens(b.choice) / b.tokens - 1) > 4 * self.margin)
        if not due:
            return b.choice
        rival = self._cheapest(b, [k for k in self.ks if k != b.choice])
        # Where the choice speculates, its acceptance is fresh evidence: a rival it prices a margin below the
        # choice is expected to gain, and is probed whatever the budget. Plain decoding observes no acceptance,
        # only its cost growing with the contexts past other ks' old measurements, which is no evidence: with
        # such probes unbudgeted there too, a loaded run of the shipped draft at batch 32 ended up speculating
        # (0.96x of plain decoding's TPOT, 0.80x of its throughput).
        if ((b.choice and self._price(b, rival) * (1 + self.margin) < self._price(b, b.choice))
                or self._probing_cost(b) <= self.probe_budget * b.spent):
            b.probe_k, b.last_probe = rival, b.steps
            # Its steps are measured afresh: old ones were taken on other text, contexts and load.
            b.modes[b.probe_k] = _Mode(b.window, settle=0)
            # At least half a first measurement's request-steps: at batch 1 the median of 5 steps swung
            # enough to leave a k that paid 20% for plain decoding.
            b.probe_left = max(self.probe_steps, b.needed // 2)
            return b.probe_k
        return b.choice

    def record(self, emitted: list[int], seconds: float, verified: int, proposed: int) -> None:
        """One step's result: ``emitted[i]`` tokens for decoding request i in ``seconds`` of the model
        runner, having verified the ``verified`` proposals per request chosen the step before and proposed
        ``proposed``."""
        total = sum(emitted)
        if total < 1:
            return
        b = self._bucket(len(emitted))
        b.spent += seconds
        mode = b.modes[proposed]
        # A k's first steps (to the end of its ``settle_steps``, the switches into it included) hold its
        # one-off costs, eager runs and kernel tapes recorded (~1 s of CPU time at batch 1 for the shipped
        # draft's four ks): not what probing costs from then on, and counted as such they kept every probe
        # out of the budget for tens of thousands of steps.
        if (verified != b.choice or proposed != b.choice) and not mode.settle:
            b.off_seconds += seconds
            b.off_tokens += total
            b.recent_seconds += seconds
            b.recent_tokens += total
        if verified == proposed:
            mode.add(seconds, len(emitted))
            if proposed:
                b.acceptance.add(proposed, emitted)

    def record_overhead(self, seconds: float, batch_size: int, proposed: int) -> None:
        """Time between two steps spent outside the runner (scheduling, output processing), after a step
        where ``batch_size`` requests decoded and proposed ``proposed`` tokens each: a cost of each step of
        that k, which speculation spreads over more tokens."""
        if batch_size >= 1:
            b = self._bucket(batch_size)
            recent = b.overhead.get(proposed)
            if recent is None:
                recent = b.overhead[proposed] = _Recent(b.window)
            recent.add(seconds)
            b.spent += seconds
            if proposed != b.choice:
                b.off_seconds += seconds
                b.recent_seconds += seconds

    def best_proposals(self, batch_size: int) -> Optional[int]:
        """The proposals per request chosen for ``batch_size`` (None: not all measured yet)."""
        b = self._buckets.get(batch_size.bit_length())
        return None if b is None else b.choice

    def _borrowed(self, bucket: int) -> int:
        """The choice of the nearest bucket that has one (the larger on a tie), 0 when none has."""
        chosen = [n for n, b in self._buckets.items() if b.choice is not None]
        if not chosen:
            return 0
        return self._buckets[min(chosen, key=lambda n: (abs(n - bucket), -n))].choice

    def _measure_next(self, b: _Bucket) -> int:
        """Before the first choice: the ks being measured in turn, ``probe_steps`` steps each, round after
        round, so that they share the text, the contexts and the load of the same moments (measured one
        after the other, k=1 on a text the draft copied well and k=0 on one it did not, k=1 won at batch
        32 where it cost 5-10% more than plain decoding), until each has ``needed`` steps. Then the cheapest
        k, measured or predicted (``_per_token``), is chosen, or measured next where it was not yet; and
        where the largest measured k is the cheapest, one more is measured: the prediction's line through
        plain decoding's cost puts speculation's fixed cost (the draft's catch-up forward, verification)
        on every proposal, and so prices more proposals high."""
        if not b.probe_left:
            if all(b.modes[k].count >= b.needed for k in b.measuring):
                measured = [k for k in self.ks if b.modes[k].count >= b.needed]
                best = self._cheapest(b, measured)
                k = self._cheapest(b, self.ks)
                if k == best and best == max(measured) < self.max_k:
                    k += 1  # the most proposals measured pay most: one more may pay more still
                if k in measured:
                    b.choice, b.last_probe, b.tokens = k, b.steps, b.acceptance.tokens(k)
                    self._settle(b)
                    return k
                # Measured next, in turn with the cheapest measured k, the one it must beat.
                b.measuring, b.turn = [k, best], -1
            b.turn = (b.turn + 1) % len(b.measuring)
            b.probe_k, b.probe_left = b.measuring[b.turn], self.probe_steps
        b.probe_left -= 1
        return b.probe_k

    def _bucket(self, batch_size: int) -> _Bucket:
        bucket = batch_size.bit_length()
        if bucket not in self._buckets:
            # A measurement holds at least ``min_requests`` request-steps of the bucket's smallest batch:
            # at batch 1 the mean of 8 steps' acceptance is ±0.15 tokens, the gain of a good draft.
            needed = max(self.warmup_steps, -(-self.min_requests // (1 << (bucket - 1))))
            window = max(self.window, needed)
            modes = {k: _Mode(window, self.settle_steps) for k in self.ks}
            self._buckets[bucket] = _Bucket(modes, _Acceptance(self.max_k, window), needed, window)
        return self._buckets[bucket]

    def _cheapest(self, b: _Bucket, ks: list[int]) -> int:
        return min(ks, key=lambda k: self._price(b, k))

    def _price(self, b: _Bucket, k: int) -> float:
        """Seconds per token, speculation's raised by ``margin``: its steps do not show all it costs (the
        draft's share of prompt steps, its catch-up after a switch, proposals the scheduler drops), and at
        batch 32 the shipped draft's k=1 measured level with plain decoding where it was 5-8% dearer."""
        return self._per_token(b, k) * (1 + self.margin if k else 1)

    def _probing_cost(self, b: _Bucket) -> float:
        """Seconds the bucket spent off its choice beyond what the choice would have cost for the same
        tokens at its price now: where the choice turned dear (the text changed), probing is cheap."""
        return b.off_seconds - b.off_tokens * self._per_token(b, b.choice)

    def _settle(self, b: _Bucket) -> None:
        """Price the steps off the choice since the last settling at the choice's price now, measured beside
        them (priced later, steps taken on shorter contexts look cheap against a choice whose cost grew
        with its contexts): below 0, the choice is likely wrong."""
        b.off_excess += b.recent_seconds - b.recent_tokens * self._per_token(b, b.choice)
        b.recent_seconds, b.recent_tokens = 0.0, 0

    def _per_token(self, b: _Bucket, k: int) -> float:
        """Seconds per emitted token of k proposals per request: a step's seconds per request (the median
        of k's recent steps, and of the time after them outside the runner) over the tokens a request
        emits in a step of k (``_Acceptance``). A k not measured yet is priced by the prediction: its seconds
        per request on the line through plain decoding's and the largest measured k's (each proposal adds a
        draft forward and a verified row), infinite while none is measured."""
        cost = self._step_cost(b, k)
        if cost is None:
            measured = [m for m in b.modes if m and b.modes[m].batches]
            plain = self._step_cost(b, 0)
            if not measured or plain is None:
                return math.inf
            m = max(measured)
            cost = plain + (self._step_cost(b, m) - plain) * k / m
        return cost / b.acceptance.tokens(k)

    @staticmethod
    def _step_cost(b: _Bucket, k: int) -> Optional[float]:
        """Seconds per request of a step of k, in the runner and after it (None: not measured)."""
        inside = b.modes[k].per_request
        if inside is None:
            return None
        overhead = b.overhead.get(k)
        if overhead is None or not overhead.values:
            return inside
        return inside + overhead.value / (b.modes[k].requests / len(b.modes[k].batches))
