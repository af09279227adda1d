"""The worker's half of the KV tiers, as a seam: what a rank needs from any
implementation of the tiers below its pool (host memory and disk here;
another store, e.g. a remote one, would be another connector)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from octavo.kv_offload.transfers import KVTransfer, TierLayout, TierReport


class KVTierConnector(ABC):
    """Holds this rank's share of every block the tiers keep.

    ``layout`` is asked once, at start: capacities and what an earlier run
    left behind. ``apply`` runs every step that carries moves, before the
    step's block copies and forward, and must apply them in order: the
    scheduler's half relies on that order alone for correctness (see
    ``octavo/kv_offload/transfers.py``). When ``apply`` returns, every move
    but the loads from disk is done as far as the pool is concerned: loaded
    blocks hold their K/V and evicted ones may be overwritten. Loads from
    disk only start there; ``finish_loads``, called every step after
    ``apply``, fills the blocks whose loads are done and reports them (and
    what failed: a failure is a miss, never an error of the step)."""

    @abstractmethod
    def layout(self) -> TierLayout:
        """Capacities in blocks, the bytes of one block on this rank, the blocks found on disk."""

    @abstractmethod
    def apply(self, transfers: Sequence[KVTransfer]) -> None:
        """Carry out one step's moves, in order."""

    @abstractmethod
    def finish_loads(self, wait: bool) -> TierReport:
        """The loads done since the last call (their blocks filled now), those failed, the writes failed.
        ``wait``: the step computes nothing, so a short wait for a load costs nothing."""
