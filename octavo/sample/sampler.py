"""The sampler: logits of the last position of each request -> next tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from octavo.sample.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # log-softmax of the raw logits (before temperature and filters); None when
    # no row asked for logprobs.
    logprobs: Optional[torch.Tensor] = None  # [B, V] float32


class Sampler:
    """Greedy rows take the argmax; the others sample from the filtered,
    temperature-scaled distribution. Seeded rows draw from their own
    generator so their tokens do not depend on the rest of the batch."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1)
        greedy_tokens = logits.argmax(dim=-1)
        if meta.all_greedy:
            return SamplerOutput(greedy_tokens, logprobs)

        temperature = meta.temperature.clamp_min(1e-5).unsqueeze(1)
        scaled = logits / temperature
        scaled = _apply_top_k_top_p_min_p(scaled, meta)
        probs = torch.softmax(scaled, dim=-1)
        sampled = _sample_exponential(probs, meta.generators)
        is_greedy = meta.temperature < 1e-5
        return SamplerOutput(torch.where(is_greedy, greedy_tokens, sampled), logprobs)


def _apply_top_k_top_p_min_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.needs_min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (meta.needs_top_k or meta.needs_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if meta.needs_top_k:
        k = torch.where(meta.top_k > 0, meta.top_k, torch.full_like(meta.top_k, vocab))
        positions = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(positions >= k.unsqueeze(1), float("-inf"))
    if meta.needs_top_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass strictly before it is below top_p, so the
        # most likely token always survives.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(
            mass_before >= meta.top_p.unsqueeze(1), float("-inf")
        )
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _sample_exponential(probs: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) draws from p; rows with a generator draw
    their own noise."""
    noise = torch.empty_like(probs).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)
