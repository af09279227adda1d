"""The proposer for a SpeculativeConfig: a registry of proposer factories by
``speculative_method``, holding n-gram and the draft model; a proposer
defined elsewhere registers itself here."""
from __future__ import annotations

from typing import Callable, Optional

from octavo.config import SpeculativeConfig
from octavo.spec_decode.draft_model import DraftModelProposer
from octavo.spec_decode.ngram import NgramProposer
from octavo.spec_decode.proposer import Proposer, ProposerContext

ProposerFactory = Callable[[SpeculativeConfig, ProposerContext], Proposer]


def _ngram(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
    return NgramProposer(config.ngram_min, config.ngram_max)


_PROPOSERS: dict[str, ProposerFactory] = {"ngram": _ngram, "draft_model": DraftModelProposer}


def register_proposer(method: str, factory: ProposerFactory) -> None:
    """Make ``factory`` the proposer of ``speculative_method`` ``method`` (replacing one of that name)."""
    _PROPOSERS[method] = factory


def create_proposer(config: SpeculativeConfig, context: ProposerContext) -> Optional[Proposer]:
    """None when speculative decoding is off; ValueError for a method no proposer is registered for."""
    method = config.method
    if method == "none":
        return None
    factory = _PROPOSERS.get(method)
    if factory is None:
        raise ValueError(f"speculative_method {method!r} has no proposer; known: none, {', '.join(_PROPOSERS)}")
    return factory(config, context)
