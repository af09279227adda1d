"""A snapshot of the engine's state and counters, for metrics and logs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    # Cumulative counters (monotonic over the engine's life).
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks
