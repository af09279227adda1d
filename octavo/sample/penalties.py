"""Repetition, presence and frequency penalties for a batch, as dense [B, V] inputs.

- repetition_penalty (Hugging Face semantics): every token that occurs in the
  prompt or the output has its logit divided by the penalty when positive and
  multiplied by it when negative.
- presence / frequency penalties (OpenAI semantics), over output tokens only:
  ``logit -= frequency * count + presence * (count > 0)``.

Token histories are packed into one padded [B, L] tensor whose pad id is
``vocab_size``: scattering into V + 1 columns and dropping the last one needs
no per-row masking. Rows whose penalty is neutral get an empty history, so
their logits pass through bit-for-bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from octavo.core.step_state import CachedRequestState


@dataclass
class PenaltyInputs:
    repetition: torch.Tensor  # [B] float32; 1 = off
    presence: torch.Tensor  # [B] float32; 0 = off
    frequency: torch.Tensor  # [B] float32; 0 = off
    seen: Optional[torch.Tensor]  # [B, V] bool: in prompt or output; None when no row has a repetition penalty
    output_counts: Optional[torch.Tensor]  # [B, V] float32; None when no row has presence/frequency

    @classmethod
    def from_requests(
        cls, requests: Sequence[CachedRequestState], vocab_size: int, device: torch.device
    ) -> Optional[PenaltyInputs]:
        """None when no request in the batch has a penalty."""
        params = [r.sampling_params for r in requests]
        wants_rep = [p.repetition_penalty != 1.0 for p in params]
        wants_out = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        if not (any(wants_rep) or any(wants_out)):
            return None

        def as_tensor(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        seen = output_counts = None
        if any(wants_rep):
            histories = [r.all_token_ids if w else [] for r, w in zip(requests, wants_rep)]
            seen = token_counts(histories, vocab_size, device) > 0
        if any(wants_out):
            histories = [r.output_token_ids if w else [] for r, w in zip(requests, wants_out)]
            output_counts = token_counts(histories, vocab_size, device)
        return cls(
            repetition=as_tensor([p.repetition_penalty for p in params]),
            presence=as_tensor([p.presence_penalty for p in params]),
            frequency=as_tensor([p.frequency_penalty for p in params]),
            seen=seen,
            output_counts=output_counts,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised copy of ``logits`` [B, V]."""
        if self.seen is not None:
            penalty = self.repetition.unsqueeze(1)
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(self.seen, penalised, logits)
        if self.output_counts is not None:
            counts = self.output_counts
            logits = (
                logits
                - self.frequency.unsqueeze(1) * counts
                - self.presence.unsqueeze(1) * (counts > 0).float()
            )
        return logits


def token_counts(histories: Sequence[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32: how often each token occurs in each row's history."""
    width = max((len(h) for h in histories), default=0)
    padded = torch.full((len(histories), width), vocab_size, dtype=torch.int64)
    for row, history in enumerate(histories):
        padded[row, : len(history)] = torch.as_tensor(history, dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros(len(histories), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]
