"""Which tensor- and pipeline-parallel rank this process is, and its groups.

One process by default: rank 0 of size 1 for both, no torch.distributed
needed, so the parallel layers run unchanged in a single process. The
multi-process executor calls ``init_model_parallel`` in every worker after
``torch.distributed.init_process_group``; tests simulate rank r of n without
any process group through the ``parallel_state`` context manager (the layers
read their rank and size when they are built, so a layer built inside it
holds rank r's shard).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # The ranks that split each layer with this one; None: no collective can
    # run (one process, or a simulated rank in a test).
    tp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    # The tensor-parallel ranks hold whole experts of a mixture (a share each) instead of a slice of
    # every expert; attention and the rest of the layer stay split as tensor parallelism splits them.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        for kind in ("tp", "pp"):
            rank, size = getattr(self, f"{kind}_rank"), getattr(self, f"{kind}_size")
            if size < 1:
                raise ValueError(f"{kind}_size must be >= 1, got {size}")
            if not 0 <= rank < size:
                raise ValueError(f"{kind}_rank must be in [0, {kind}_size={size}), got {rank}")


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_size() -> int:
    return _state.tp_size


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


@contextmanager
def parallel_state(state: ParallelState) -> Iterator[ParallelState]:
    """``state`` for the duration of the block, then the previous one again."""
    previous = _state
    set_parallel_state(state)
    try:
        yield state
    finally:
        set_parallel_state(previous)


def init_model_parallel(tp_size: int, pp_size: int = 1, expert_parallel: bool = False) -> ParallelState:
    """Split the initialised torch.distributed world (tp_size * pp_size ranks)
    into groups and make them this process's state. Rank = pp_rank * tp_size
    + tp_rank: the ranks of one pipeline stage are neighbours, so a stage's
    all-reduces stay on one machine when ranks fill machines in order.

    ``expert_parallel``: the experts of a mixture are shared out whole over a stage's
    tensor-parallel ranks (``ParallelState.expert_parallel``).

    Every rank must call this (``new_group`` is collective)."""
    if not dist.is_initialized():
        raise ValueError("init_model_parallel needs torch.distributed.init_process_group to have run first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size * pp_size != world:
        raise ValueError(f"tensor_parallel_size {tp_size} x pipeline_parallel_size {pp_size} != world size {world}")
    tp_group = pp_group = None
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        if rank // tp_size == stage:
            tp_group = group
    for column in range(tp_size):
        group = dist.new_group(list(range(column, world, tp_size)))
        if rank % tp_size == column:
            pp_group = group
    state = ParallelState(rank % tp_size, tp_size, rank // tp_size, pp_size, tp_group, pp_group, expert_parallel)
    set_parallel_state(state)
    return state


def stage_layers(num_layers: int, state: ParallelState) -> range:
    """The decoder layers of this rank's pipeline stage: an even split, the
    first ``num_layers % pp_size`` stages one layer more."""
    if state.pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {state.pp_size} is larger than the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, state.pp_size)
    start = state.pp_rank * base + min(state.pp_rank, extra)
    return range(start, start + base + (state.pp_rank < extra))
