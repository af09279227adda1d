"""Per-step sampling parameters of the batch, as tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from octavo.core.outputs import GrammarBitmask
from octavo.core.step_state import CachedRequestState
from octavo.sample.masks import TokenMasks
from octavo.sample.penalties import PenaltyInputs
from octavo.sample.structured import GrammarBatch


@dataclass
class SamplingMetadata:
    """Row i describes ``requests[i]``; all rows are sampled in one pass.

    Optional parts are None when no row of the batch uses them, so a plain
    batch pays for none of them."""

    request_ids: list[str]
    temperature: torch.Tensor  # [B] float32; rows below GREEDY_TEMPERATURE are greedy
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
    requests: Sequence[CachedRequestState]
    penalties: Optional[PenaltyInputs] = None
    masks: Optional[TokenMasks] = None
    grammars: Optional[GrammarBatch] = None

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[CachedRequestState],
        generators: list[Optional[torch.Generator]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        grammar: Optional[GrammarBitmask] = None,
        positions: Optional[list[int]] = None,
    ) -> SamplingMetadata:
        """``requests``: the batch rows (scheduler ``Request`` objects or the
        worker's states, which have the same fields); ``grammar``: the step's
        shipped grammar masks, for the rows that have one; ``positions``:
        with speculative proposals, which of its request's verified positions
        each row is (None: 0 for every row)."""
        if len(generators) != len(requests):
            raise ValueError(f"need one generator slot per request: {len(generators)} for {len(requests)}")
        device = torch.device(device)
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params], dtype=torch.int64, device=device
        )
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        return cls(
            request_ids=[r.request_id for r in requests],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            all_greedy=all(p.greedy for p in params),
            needs_top_k=any(0 < p.top_k < vocab_size for p in params),
            needs_top_p=any(p.top_p < 1.0 for p in params),
            needs_min_p=any(p.min_p > 0.0 for p in params),
            generators=generators,
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            requests=requests,
            penalties=PenaltyInputs.from_requests(requests, vocab_size, device),
            masks=TokenMasks.from_requests(requests, vocab_size, device),
            grammars=GrammarBatch.from_bitmask(
                [r.request_id for r in requests], grammar, vocab_size, device, positions
            ),
        )
