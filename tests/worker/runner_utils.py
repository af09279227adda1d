"""Drive a ModelRunner by hand: requests, block allocation, scheduled chunks."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch

from octavo.config import CacheConfig, ModelConfig, SchedulerConfig
from octavo.core.outputs import ScheduledRequest, SchedulerOutput
from octavo.core.request import Request
from octavo.core.step_state import SentRequests
from octavo.sampling_params import SamplingParams
from octavo.worker.model_runner import ModelRunner


def make_runner(
    folder: Path,
    block_size: int = 16,
    num_blocks: int = 64,
    dtype: str = "float32",
    cache_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    **model_kwargs: object,
) -> ModelRunner:
    return ModelRunner(
        ModelConfig(model=str(folder), dtype=dtype, **model_kwargs),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, cache_dtype=cache_dtype,
                    kv_cache_dtype=kv_cache_dtype),
        SchedulerConfig(),
    )


def make_request(request_id: str, prompt: list[int], **params: object) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(request_id, list(prompt), SamplingParams(**params))


class Blocks:
    """Hands out block ids in a shuffled order, so block tables are never the
    identity and a wrong lookup cannot pass by accident."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.block_size = runner.block_size
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.num_groups = len(runner.kv_cache_windows)
        # Per request, a table per KV cache group, kept whole (nothing released).
        self.tables: dict[str, list[list[int]]] = {}
        self.sent = SentRequests(self.block_size)  # the steps carry deltas, as the scheduler's do

    def chunk(self, request: Request, start: int, num_tokens: int, sample: bool = True) -> ScheduledRequest:
        """Schedule ``request.all_token_ids[start : start + num_tokens]``, growing its block tables."""
        tables = self.tables.setdefault(request.request_id, [[] for _ in range(self.num_groups)])
        for table in tables:
            while len(table) * self.block_size < start + num_tokens:
                table.append(self.free.pop())
        return self.sent.delta(request, start, num_tokens, tables, sample)

    def share(self, src: Request, dst: Request, num_blocks: int) -> None:
        """dst's tables start with src's first ``num_blocks`` blocks (a prefix-cache hit)."""
        self.tables[dst.request_id] = [list(table[:num_blocks]) for table in self.tables[src.request_id]]

    def take(self) -> int:
        return self.free.pop()


def step(*scheduled: ScheduledRequest, copies: Optional[list[tuple[int, int]]] = None) -> SchedulerOutput:
    return SchedulerOutput(scheduled=list(scheduled), block_copies=copies or [])


def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The reference: transformers' logits for every position of ``tokens``."""
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()
