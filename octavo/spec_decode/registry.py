"""The proposer for a SpeculativeConfig."""
from __future__ import annotations

from typing import Optional

from octavo.config import SpeculativeConfig
from octavo.spec_decode.ngram import NgramProposer
from octavo.spec_decode.proposer import Proposer, ProposerContext


def create_proposer(config: SpeculativeConfig, context: ProposerContext) -> Optional[Proposer]:
    """None when speculative decoding is off."""
    method = config.method
    if method == "none":
        return None
    if method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    # draft_model is built by the model runner (octavo/worker/draft_runner.py),
    # which sizes the KV pool for both models' caches.
    raise ValueError(f"speculative_method {method!r} is not available in this build")
