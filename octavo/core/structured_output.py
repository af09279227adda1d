"""The structured-output seam (torch-free): what the engine, the scheduler and
the sampler's mask packing need from a grammar engine, and nothing more.

A ``StructuredOutputBackend`` is built once per engine for its tokenizer; it
compiles a request's ``StructuredOutputParams`` (JSON schema, any JSON object,
regex or a fixed choice) into a ``StructuredOutputGrammar``, one per
sequence, which lives on the scheduler side (``Request.grammar``). Every step
the grammars of the sampling requests fill their rows of a token bitmask
(token t allowed when bit t % 32 of int32 word t // 32 is set); once the
step's tokens are back the scheduler advances each grammar by them.
Speculative decoding walks a grammar through the proposals being verified
and rolls it back after.

Backends are chosen by name from ``octavo/sample/structured_registry.py``;
llguidance (``octavo/sample/llguidance_backend.py``) is the default.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

from octavo.sampling_params import StructuredOutputParams

if TYPE_CHECKING:  # masks are filled on the engine side, which has torch; this module stays torch-free
    import torch


class StructuredOutputGrammar(ABC):
    """One sequence's position in its compiled constraint."""

    # Width of the grammar's token masks (the tokenizer's vocabulary, which
    # may differ from the model's padded one): bits past it stay 0.
    vocab_size: int

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by sampled tokens; False (and terminated from then on) at
        the first one the grammar does not allow."""

    @abstractmethod
    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, in order, the grammar would accept from
        here; the grammar does not move."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative
        proposals walked through to compute their masks)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write what may follow now into row ``row`` of ``bitmask`` [rows,
        words] int32, every bit of the row (forbidden ones cleared)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once nothing but EOS may follow (complete, or in error)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the constraint, as freshly compiled."""


class StructuredOutputBackend(ABC):
    """A grammar engine bound to one tokenizer; built once per engine."""

    @abstractmethod
    def compile(self, spec: StructuredOutputParams) -> StructuredOutputGrammar:
        """A fresh grammar for one sequence; ValueError naming the problem
        for a schema, regex or choice the engine cannot serve."""

    def fill_bitmasks(self, bitmask: torch.Tensor, rows: Sequence[tuple[StructuredOutputGrammar, int]]) -> None:
        """Fill each ``(grammar, row)``'s row of ``bitmask``. One by one
        here; a backend whose engine computes many masks at once overrides
        this (it runs every step, for every constrained request)."""
        for grammar, row in rows:
            grammar.fill_bitmask(bitmask, row)
