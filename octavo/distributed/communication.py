"""Collectives over this rank's tensor-parallel group (and one over every rank).

No-ops at tp_size 1, so the single-process path pays one attribute read per
call and never touches torch.distributed."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from octavo.distributed.parallel_state import ParallelState, get_parallel_state


def _group(state: ParallelState) -> dist.ProcessGroup:
    if state.tp_group is None:
        raise RuntimeError(
            f"tensor parallel size {state.tp_size} but no process group: call init_model_parallel first"
        )
    return state.tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks (in place where it runs)."""
    state = get_parallel_state()
    if state.tp_size == 1:
        return x
    dist.all_reduce(x, group=_group(state))
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    state = get_parallel_state()
    if state.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=_group(state))
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_gather(x: torch.Tensor, dim: int = -1) -> Optional[torch.Tensor]:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, on the
    group's first rank (the driver); None on the others, which need not hold
    the whole (a vocabulary of logits per row, say) at all."""
    state = get_parallel_state()
    if state.tp_size == 1:
        return x
    group = _group(state)
    x = x.contiguous()
    first = dist.get_global_rank(group, 0)
    if state.tp_rank != 0:
        dist.gather(x, None, dst=first, group=group)
        return None
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.gather(x, parts, dst=first, group=group)
    return torch.cat(parts, dim=dim)


def pipeline_send(tensors: list[torch.Tensor]) -> None:
    """Hand ``tensors`` to the same tensor-parallel rank of the next stage."""
    state = get_parallel_state()
    dst = dist.get_rank() + state.tp_size
    for t in tensors:
        dist.send(t.contiguous(), dst=dst)


def pipeline_recv(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``count`` tensors of ``shape`` from the same tensor-parallel rank of the previous stage."""
    state = get_parallel_state()
    src = dist.get_rank() - state.tp_size
    out = []
    for _ in range(count):
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src)
        out.append(t)
    return out


def all_ranks_min(values: list[int], device: torch.device) -> list[int]:
    """Each position's smallest value over every rank of the engine (all
    stages); ``values`` itself with one rank. Every rank must call it with as
    many values, at the same point of the same step."""
    state = get_parallel_state()
    if state.tp_size * state.pp_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.int32, device=device)  # NCCL reduces only device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()
