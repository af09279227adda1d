"""The Proposer seam: what a speculative-decoding proposer gets and returns.

Where proposals live (the step contract, ``octavo/core/outputs.py``):

1. Step t: the model runner verifies the proposals scheduled with the step,
   emits each sampling request's tokens, then calls ``Proposer.propose`` with
   every scheduled row (a draft model must also see prompt chunks that do not
   sample, to fill its own KV cache). The proposed ids travel back in
   ``ModelRunnerOutput.spec_token_ids``; a model proposer's distributions q stay
   on the driver rank, in the runner, keyed by request id (they are large, and
   only the rejection sampler on this rank reads them).
2. The scheduler keeps the ids on the request and, at step t+1, schedules them
   as extra tokens after the request's last token (``ScheduledRequest.
   spec_token_ids``), within the token budget and the KV pool; it may keep
   only a prefix of them, or none.
3. Step t+1's forward computes logits at every proposed position; the rejection
   sampler accepts a prefix and emits one more token; the scheduler rolls the
   rejected positions back (``num_computed_tokens``, and blocks left empty).

The runner calls the proposer on the driver rank only (the rank that samples,
so the only one that knows this step's tokens); other ranks never build one.

KV for a draft model: a draft model keeps its own paged cache with the same
block size and block count as the target's, indexed by the same block ids, so
the scheduler's block tables serve both. The scheduler reserves
``SpeculativeConfig.num_lookahead_slots`` slots past the verified positions
so that the draft can write the K/V of its own k proposal steps; those slots
are scratch (rolled back with the rejected tokens). The model runner builds
the proposer before it sizes the pool: the draft has the runner load its
model and reserve its cache (``ProposerContext.host``, a
``model_host.DraftModelHost``), and ``num_cache_blocks`` counts both caches
per block.

Adding a proposer: a subclass of ``Proposer`` and a factory registered for
its ``SpeculativeConfig.method`` (``registry.register_proposer``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

from octavo.config import CacheConfig, ModelConfig
from octavo.core.step_state import CachedRequestState
from octavo.model.config import ArchConfig
from octavo.spec_decode.model_host import DraftModelHost


@dataclass(frozen=True)
class ProposerContext:
    """What the target's model runner knows that a proposer may need to
    build itself, given before the KV pool is sized (a draft model: the
    target's vocabulary and context length to match, and the runner's help
    to load itself and have a cache in the pool)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    device: torch.device
    max_model_len: int
    target_arch: ArchConfig
    host: DraftModelHost
    # The most tokens of one target step: a draft's own forwards stay within it too.
    max_num_batched_tokens: int


@dataclass
class ProposalInput:
    """One scheduled row of the step just run, as a proposer sees it.

    ``state.all_token_ids`` are the request's tokens before this step's
    results (prompt + outputs); ``new_token_ids`` are the tokens this step
    emitted for it (the accepted proposals, then the target's own token), not
    yet in ``state``: the request continues from ``state.all_token_ids +
    new_token_ids``. Positions ``start_pos .. start_pos + num_tokens - 1``
    were computed by the target this step (the proposals verified among them;
    only the first ``len(state.all_token_ids) + len(new_token_ids) - 1``
    positions hold K/V of real tokens). ``state.block_ids`` is the request's
    block table, covering the lookahead slots too."""

    state: CachedRequestState
    start_pos: int
    num_tokens: int
    new_token_ids: list[int]
    # Proposals that can still be used: k, fewer near max_tokens or the end of
    # the context; 0 for a row that did not sample (a prompt chunk).
    max_proposals: int
    # The target's last hidden states at this row's emitted positions
    # ([len(new_token_ids), hidden]); only filled when the proposer sets
    # ``needs_hidden_states`` (an EAGLE-style head).
    hidden_states: Optional[torch.Tensor] = None

    @property
    def request_id(self) -> str:
        return self.state.request_id


@dataclass
class Proposal:
    """Up to ``max_proposals`` guessed next tokens of one request. ``probs``:
    the proposer's distribution q at each proposed position, [len(token_ids),
    vocab] float32 on the model's device, from which token i was drawn; None
    for a deterministic proposer (n-gram), whose q is one-hot at its token."""

    token_ids: list[int] = field(default_factory=list)
    probs: Optional[torch.Tensor] = None


class Proposer(ABC):
    """Guesses each request's next tokens after a step of the target model."""

    # Set by proposers that read the target's hidden states (EAGLE-style
    # heads); the runner then fills ``ProposalInput.hidden_states``.
    needs_hidden_states: bool = False

    @abstractmethod
    def propose(self, rows: list[ProposalInput]) -> list[Proposal]:
        """One Proposal per row, in order (an empty one where there is nothing
        to guess or ``max_proposals`` is 0). Called once per step, after the
        step's tokens are emitted, on every scheduled row."""

    def remove_requests(self, request_ids: set[str]) -> None:
        """The requests left (finished, aborted, preempted): drop any state
        kept for them. A preempted request comes back with its whole history."""
