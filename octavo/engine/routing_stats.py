"""Routing statistics of a mixture-of-experts model, for /metrics: the (token, choice) pairs routed to
each expert of each layer, and each layer's load imbalance, the busiest expert's pairs over the mean
(1 = even; top-k of E experts can reach E / k when the same experts take every token).

The ranks count on the device as they route (``model/layers/route_counts.py``: one index_add_ per
layer per step); the engine reads the counts every ``READ_EVERY_STEPS`` steps that ran a forward, and
when it has no request left, each read one collective RPC returning a few integers per expert. A read
waits for a moment with no step in flight: a rank's reply to the RPC must not interleave with its
reply to a step (with pipeline stages, under steady load, that moment comes when the pipeline drains).
Ranks of one stage hold the same counts (the router is replicated); stages hold disjoint layers."""
from __future__ import annotations

from octavo.executor.base import Executor

# Reads are a round trip to every rank; at ~10 ms steps, 32 steps is a read every third of a second,
# about what the front sees (it gets a snapshot every 0.1 s at most).
READ_EVERY_STEPS = 32


class RoutingStatsReader:
    """The engine's copy of the ranks' routing counts and the imbalance over the last window read."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self.routed_tokens = self._read()  # cumulative pairs per expert, by layer
        self.enabled = bool(self.routed_tokens)  # a dense model has nothing to read, ever
        self.load_imbalance: dict[int, float] = {}  # by layer: max / mean over the last window with tokens
        self._steps = 0

    def step_ran(self) -> None:
        self._steps += 1

    def maybe_read(self, nothing_in_flight: bool, idle: bool) -> None:
        """Read when ``READ_EVERY_STEPS`` forward steps have run since the last read, or any have and the
        engine is ``idle``, provided ``nothing_in_flight`` on the ranks."""
        if not self.enabled or not self._steps or not nothing_in_flight:
            return
        if self._steps < READ_EVERY_STEPS and not idle:
            return
        self._steps = 0
        counts = self._read()
        for layer, now in counts.items():
            before = self.routed_tokens.get(layer, [0] * len(now))
            window = [a - b for a, b in zip(now, before)]
            if any(window):
                self.load_imbalance[layer] = max(window) * len(window) / sum(window)
        self.routed_tokens = counts

    def _read(self) -> dict[int, list[int]]:
        merged: dict[int, list[int]] = {}
        for rank_counts in self._executor.collective_rpc("moe_routing_counts"):
            merged.update(rank_counts)
        return dict(sorted(merged.items()))
