"""Per-step sampling parameters of the batch, as tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from octavo.core.request import Request


@dataclass
class SamplingMetadata:
    """Row i describes ``requests[i]``; all rows are sampled in one pass."""

    request_ids: list[str]
    temperature: torch.Tensor  # [B] float32; 0 rows are greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    # Rows with a seed get their own generator; None rows use the global RNG.
    generators: list[Optional[torch.Generator]]
    max_num_logprobs: Optional[int]  # None when no row asked for logprobs
    requests: Sequence[Request]

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[Request],
        generators: list[Optional[torch.Generator]],
        vocab_size: int,
    ) -> SamplingMetadata:
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params], dtype=torch.int64
        )
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        return cls(
            request_ids=[r.request_id for r in requests],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            all_greedy=all(p.greedy for p in params),
            needs_top_k=bool((top_k > 0).any()),
            needs_top_p=bool((top_p < 1.0).any()),
            needs_min_p=bool((min_p > 0.0).any()),
            generators=generators,
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            requests=requests,
        )
