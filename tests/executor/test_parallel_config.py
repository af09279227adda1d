"""ParallelConfig validation, the backend default, rank placement, and the
engine's layering (it reaches the model through the executor only)."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from octavo.config import ParallelConfig
from octavo.executor.placement import place_ranks

ENGINE_DIR = Path(__file__).resolve().parents[2] / "octavo" / "engine"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(pipeline_parallel_size=-1), "pipeline_parallel_size"),
        (dict(distributed_executor_backend="mpi"), "distributed_executor_backend"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "distributed_executor_backend"),
        (dict(threads_per_worker=0), "threads_per_worker"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**kwargs)


def test_backend_defaults_to_in_process_for_one_rank_else_processes():
    assert ParallelConfig().executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).executor_backend == "mp"
    assert ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2).world_size == 4
    assert ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray").executor_backend == "ray"


def test_ranks_get_disjoint_cores_when_they_fit():
    cores = sorted(os.sched_getaffinity(0))
    one = place_ranks(1, None)
    assert one[0].threads == len(cores) and one[0].cpus == cores
    many = place_ranks(len(cores) + 1, None)  # more ranks than cores: one thread each, no pinning
    assert all(p.threads == 1 and p.cpus is None for p in many)
    if len(cores) >= 2:
        halves = place_ranks(2, 1)
        assert [p.cpus for p in halves] == [cores[:1], cores[1:2]]


def test_the_engine_imports_no_worker_module():
    for path in ENGINE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("octavo.worker"), f"{path.name} imports {node.module}"
