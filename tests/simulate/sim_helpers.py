"""Small fleets and cost models with round numbers, for simulator tests."""
from __future__ import annotations

from typing import Optional

from octavo.config import CacheConfig, SchedulerConfig
from octavo.simulate.cost_model import FEATURES, CostModel
from octavo.simulate.replica import ReplicaShape
from octavo.simulate.simulator import FleetConfig, Scaler, SimResult, Simulator
from octavo.simulate.traces import TraceRequest


def cost_model(**coefficients: float) -> CostModel:
    """Zero for every feature not named."""
    return CostModel({f: coefficients.get(f, 0.0) for f in FEATURES})


def shape(max_num_seqs: int = 16, max_num_batched_tokens: int = 512, chunked: bool = True,
          num_blocks: int = 1000, block_size: int = 16, max_model_len: int = 4096) -> ReplicaShape:
    return ReplicaShape(SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked),
                        CacheConfig(block_size=block_size), num_blocks, max_model_len)


def simulate(trace: list[TraceRequest], cost: CostModel, replica: Optional[ReplicaShape] = None,
             fleet: Optional[FleetConfig] = None, scaler: Optional[Scaler] = None, seed: int = 0) -> SimResult:
    return Simulator(cost, replica or shape(), fleet or FleetConfig(), scaler, seed).run(trace)
