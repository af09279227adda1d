"""Speculative decoding counters, cumulative over the engine's life (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verifications: request-steps that carried proposals
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of those, accepted by the rejection sampler
    # Entry i: drafts whose proposal at position i (0-based) was accepted.
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        grow = num_proposed - len(self.accepted_per_position)
        if grow > 0:
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: the accepted proposals plus the
        target's own token (1.0 = speculation gained nothing)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
