"""Which cores each rank's process gets: an even split of the cores this
process may use, or ``threads_per_worker`` each."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RankPlacement:
    threads: int
    # Cores to pin the rank's process to; None where the OS has no
    # sched_setaffinity or the ranks need more cores than there are.
    cpus: Optional[list[int]]


def place_ranks(world_size: int, threads_per_worker: Optional[int]) -> list[RankPlacement]:
    """One placement per rank. Ranks get disjoint cores when they fit: two
    ranks' intra-op thread pools on one core would take turns at every
    all-reduce, the slowest case there is."""
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        cores = list(range(os.cpu_count() or 1))
    threads = threads_per_worker or max(1, len(cores) // world_size)
    pin = hasattr(os, "sched_setaffinity") and threads * world_size <= len(cores)
    return [
        RankPlacement(threads, cores[rank * threads : (rank + 1) * threads] if pin else None)
        for rank in range(world_size)
    ]
