"""The Executor seam: the engine core is a scheduler plus an executor.

The engine hands the executor one ``SchedulerOutput`` per step and gets one
``ModelRunnerOutput`` back; how many processes or machines run the model
behind it is the executor's business. Implementations (``registry.py``):
``uni`` runs the one worker in the engine's own process (world size 1, the
default); ``mp`` spawns one worker process per rank on this machine; ``ray``
places one worker per rank as a Ray actor.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Optional

from octavo.config import EngineConfig
from octavo.core.outputs import ModelInfo, ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """The executor can no longer run steps (a worker died or hung); the
    engine cannot continue and must be restarted."""


class Executor(ABC):
    """Runs the model for the scheduler, on one or more ranks.

    Every rank holds a Worker: its device, its ModelRunner and its shard of the
    weights and of the KV cache. The driver is tensor rank 0 of the last
    pipeline stage (the one with the logits; rank 0 when there is no
    pipeline): it samples and its result is the step's result. Calls come from one thread (the engine's)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_info: Optional[ModelInfo] = None  # set once the workers are up
        self._done: deque[ModelRunnerOutput] = deque()

    @property
    def max_concurrent_batches(self) -> int:
        """Steps that may be in flight at once (``submit``ted, not yet
        ``collect``ed): the pipeline's stages, so that each works on its own
        step; 1 without pipelining."""
        return 1

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step without waiting for it; ``collect`` returns results in
        submission order. By default the step runs here and now."""
        self._done.append(self.execute_model(scheduler_output))

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step, waiting for it if need be."""
        return self._done.popleft()

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """KV cache blocks every rank can hold: the minimum over the ranks of
        what each one sized from its memory (or the forced ``num_blocks``).
        The scheduler's pool has exactly this many blocks; block ``b`` is
        block ``b`` of every rank's shard."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank: each applies the step to its persistent
        per-request state, runs its share of the forward pass and (the driver)
        samples. Returns the driver's output; requests whose own sampling
        failed are in ``ModelRunnerOutput.failed``. Raises ExecutorError when
        a rank is gone; any other exception is a failure of the forward."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), ranks: Optional[list[int]] = None) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on ``ranks`` (default: every rank);
        the results in that order. For setup and inspection, not for the
        per-step path."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their resources; safe to call twice."""

    def check_health(self) -> None:
        """Raise ExecutorError when a rank is gone (nothing to check in process)."""
