"""What the worker lends a proposer that runs a model of its own.

A draft model needs the worker's machinery: its choice of kernels, the paged
KV pool (sized once, for every model's cache, and copied on write by block
id) and its layout of a step's rows. ``spec_decode`` sits below the worker
and cannot import it, so the worker hands these in as a ``DraftModelHost``
(``ProposerContext.host``); the proposer keeps only what proposing needs to
know: which tokens to feed at which positions, and what to do with the logits.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.core.step_state import ScheduledRow
from octavo.model.config import ArchConfig


class DraftModel(Protocol):
    """A second model, loaded whole on the driver rank (replicated, never
    split); its KV cache is paged on the target's block ids: sized with the
    target's pool, allocated with it, copied on write with it."""

    arch: ArchConfig
    attention: AttentionBackend  # builds the metadata of the steps the proposer lays out itself
    # The model's argmax (native for contiguous CPU logits, where torch's is
    # several times slower on bf16 rows).
    argmax: Callable[[torch.Tensor], torch.Tensor]

    def run_rows(self, rows: list[ScheduledRow], sample: list[ScheduledRow]) -> torch.Tensor:
        """Run ``rows`` laid out as the worker lays out a step; the logits
        [len(sample), head size] of the last position of each of ``sample``."""

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Run one step laid out by the caller; the logits of every position
        (over the head's tokens)."""


class DraftModelHost(Protocol):
    """The worker's side: it builds the draft model and owns its cache."""

    def load_draft_model(self, folder: str, head_tokens: Optional[Sequence[int]] = None) -> DraftModel:
        """Load the model in ``folder`` with the kernels the model config
        picks for its dtypes, and reserve its share of the KV pool.
        ``head_tokens``: its LM head scores these tokens only (logit i is
        ``head_tokens[i]``'s); None: the whole vocabulary."""
