"""Routing statistics of a model's mixture-of-experts blocks: the (token, choice) pairs routed to each expert,
counted on the device as the blocks route and read back only when the engine asks (``read``), so counting costs
no host sync and a recorded decode step (worker/decode_graphs.py) counts as the eager one does.

Two rules keep the counts to the tokens the engine asked for:

- Counting is two-phase. Each block writes the pairs of a forward into its row of ``step``, overwriting the
  previous forward's, and the runner adds ``step`` into ``total`` once the forward is done (``commit``). A forward
  abandoned half way and run again (a kernel-tape recording refused at the first layer it cannot hold, a replay
  whose kernel failed) so counts once: the second run overwrites what the first wrote.
- ``rows`` holds a 1 for each row that counts. The recorded steps write 0 into the rows that only pad a batch to
  its recorded size, for that step; a replay runs no Python, so the mask is tensor data the recorded counting
  reads. Forwards of more rows than the mask holds (prefill chunks) count every row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass(frozen=True)
class RouteCounter:
    """Where one block counts its routes: its row of the model's ``step`` counts, and the shared row mask."""

    step: torch.Tensor  # int64 [experts]
    rows: torch.Tensor  # int64 [max_rows, top_k]: 1 where a row counts (a column per choice: a prefix is a view)

    def count(self, ids: torch.Tensor) -> None:
        """Count a forward's routes ``ids`` [tokens, top_k] (the experts chosen per token), replacing the last."""
        tokens = ids.shape[0]
        counted = self.rows[:tokens].flatten() if tokens <= self.rows.shape[0] else torch.ones_like(ids).flatten()
        # index_add_ rather than bincount: bincount reads the largest id back to size its result, a host sync.
        self.step.zero_().index_add_(0, ids.flatten(), counted)


class RouteCounts:
    """The routing counts of every mixture block of a model (this rank's), by decoder layer index."""

    def __init__(self, blocks: dict[int, nn.Module], max_rows: int, device: torch.device) -> None:
        """``blocks``: layer index -> its ``SparseMoEBlock``; ``max_rows``: the most rows of a step whose padding
        the recorded steps mask out (its decode batches)."""
        experts = {block.experts.total_experts for block in blocks.values()}
        top_k = {block.top_k for block in blocks.values()}
        if len(experts) != 1 or len(top_k) != 1:
            raise ValueError(f"mixture blocks with different expert counts {sorted(experts)} or top-k {sorted(top_k)}")
        self.layers = list(blocks)
        self.step = torch.zeros(len(blocks), experts.pop(), dtype=torch.int64, device=device)
        self.total = torch.zeros_like(self.step)
        self.rows = torch.ones(max_rows, top_k.pop(), dtype=torch.int64, device=device)
        for index, block in enumerate(blocks.values()):
            block.route_counter = RouteCounter(self.step[index], self.rows)

    @classmethod
    def attach(cls, blocks: dict[int, nn.Module], max_rows: int, device: torch.device) -> Optional[RouteCounts]:
        """Counts for ``blocks``, each told where to count; None without blocks (a dense model)."""
        return cls(blocks, max_rows, device) if blocks else None

    def commit(self) -> None:
        """Add the forward just done to the totals: once per forward that ran to its end."""
        self.total += self.step

    def read(self) -> dict[int, list[int]]:
        """The pairs routed to each expert so far, by layer: one read of the device counters."""
        return dict(zip(self.layers, self.total.tolist()))
