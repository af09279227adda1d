"""The parallel state of one process, and collectives that cost nothing at size 1."""
from __future__ import annotations

import pytest
import torch

from octavo.distributed.communication import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from octavo.distributed.parallel_state import (
    ParallelState,
    get_parallel_state,
    get_tp_rank,
    get_tp_size,
    init_model_parallel,
    parallel_state,
)


def test_one_process_is_rank_0_of_1_without_torch_distributed():
    state = get_parallel_state()
    assert (state.tp_rank, state.tp_size, state.pp_rank, state.pp_size) == (0, 1, 0, 1)
    assert state.tp_group is None and not torch.distributed.is_initialized()


def test_collectives_are_no_ops_at_size_1():
    x = torch.randn(3, 4)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x


def test_a_simulated_rank_is_scoped_to_its_block():
    with parallel_state(ParallelState(tp_rank=1, tp_size=3)):
        assert (get_tp_rank(), get_tp_size()) == (1, 3)
        # Simulated ranks have no group: a collective is an error, not a silent no-op.
        with pytest.raises(RuntimeError, match="no process group"):
            tensor_model_parallel_all_reduce(torch.ones(2))
    assert (get_tp_rank(), get_tp_size()) == (0, 1)


@pytest.mark.parametrize("fields,message", [
    ({"tp_size": 0}, "tp_size must be >= 1"),
    ({"tp_rank": 2, "tp_size": 2}, r"tp_rank must be in \[0, tp_size=2\)"),
    ({"pp_rank": -1}, r"pp_rank must be in \[0, pp_size=1\)"),
])
def test_bad_ranks_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelState(**fields)


def test_init_needs_torch_distributed():
    with pytest.raises(ValueError, match="init_process_group"):
        init_model_parallel(2)
