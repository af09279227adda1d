"""One rank's worker: its device, its ModelRunner (weights shard, KV cache
shard, per-request state) and, on the driver rank, the sampler's results."""
from __future__ import annotations

from octavo.config import EngineConfig
from octavo.distributed.parallel_state import get_parallel_state
from octavo.core.outputs import ModelInfo, ModelRunnerOutput, SchedulerOutput
from octavo.kv_offload.transfers import KVTransfer, TierLayout
from octavo.worker.model_runner import ModelRunner


class Worker:
    """Built in the process of its rank, after that process's parallel state
    is set (``init_model_parallel``): the layers read their rank when built."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.rank = rank
        state = get_parallel_state()
        # The rank that samples: tensor rank 0 of the last pipeline stage
        # (the one with the logits).
        self.is_driver = state.tp_rank == 0 and state.pp_rank == state.pp_size - 1
        # CPU ranks share the machine's memory, so the KV budget (a fraction
        # of it, or --kv-cache-memory) is split between them; a GPU rank has
        # its own device's memory.
        share = 1.0 if config.model.device.startswith("cuda") else 1.0 / config.parallel.world_size
        # Proposals are made where the step's tokens are sampled: the driver.
        speculative = config.speculative if self.is_driver else None
        self.runner = ModelRunner(config.model, config.cache, config.scheduler, share, speculative)

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.runner.vocab_size, self.runner.max_model_len, self.runner.kv_cache_windows,
                         self.runner.decode_batch_sizes)

    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def kv_tier_layout(self) -> TierLayout:
        """This rank's tiers below the pool (the engine asks only when some are configured)."""
        return self.runner.kv_tiers.layout()

    def apply_kv_transfers(self, transfers: list[KVTransfer]) -> None:
        """Moves outside a step (persisting the tiers before the engine stops)."""
        self.runner.kv_tiers.apply(transfers)

    def moe_routing_counts(self) -> dict[int, list[int]]:
        return self.runner.moe_routing_counts()
