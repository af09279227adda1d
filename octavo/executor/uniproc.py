"""The in-process executor: the engine's own process is the only rank."""
from __future__ import annotations

from typing import Any, Optional

from octavo.config import EngineConfig
from octavo.core.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.executor.base import Executor
from octavo.worker.worker import Worker


class UniProcExecutor(Executor):
    """World size 1: one Worker, called directly. No process, no copy of the
    step; the default, and what every single-device run pays nothing extra for."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.parallel.world_size != 1:
            raise ValueError(
                f"the in-process executor runs one rank; tensor_parallel_size x pipeline_parallel_size "
                f"is {config.parallel.world_size}"
            )
        self.worker = Worker(config, rank=0)
        self.model_info = self.worker.model_info()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.num_kv_blocks()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, args: tuple = (), ranks: Optional[list[int]] = None) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        pass
