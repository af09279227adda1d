"""Which structured-output backend an engine builds: a registry of backend
factories by name. There is no config option for it: "llguidance" serves
every kind of constraint Octavo accepts; another backend registers here and
is selected with ``use_structured_output_backend``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from octavo.core.structured_output import StructuredOutputBackend

if TYPE_CHECKING:  # the engine layer sits above this one: no runtime import
    from octavo.tokenizer import Tokenizer

# (tokenizer, the model's vocabulary size, the token ids that end a sequence) -> backend
BackendFactory = Callable[["Tokenizer", int, list[int]], StructuredOutputBackend]


def _llguidance(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> StructuredOutputBackend:
    # Imported when first used: most engines never see a constrained request.
    from octavo.sample.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids=eos_token_ids)


_BACKENDS: dict[str, BackendFactory] = {"llguidance": _llguidance}
DEFAULT_BACKEND = "llguidance"
_selected = DEFAULT_BACKEND


def register_structured_output_backend(name: str, factory: BackendFactory) -> None:
    """Make ``factory`` available as backend ``name`` (replacing one of that name)."""
    _BACKENDS[name] = factory


def use_structured_output_backend(name: str) -> None:
    """The backend an engine builds at its first constrained request (one
    built before keeps serving its engine); ValueError for an unknown name."""
    global _selected
    _factory(name)
    _selected = name


def create_structured_output_backend(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int], name: Optional[str] = None
) -> StructuredOutputBackend:
    """The backend ``name`` (default: the selected one) for one engine's tokenizer."""
    return _factory(name or _selected)(tokenizer, vocab_size, eos_token_ids)


def _factory(name: str) -> BackendFactory:
    if name not in _BACKENDS:
        raise ValueError(f"structured-output backend {name!r} is not registered; known: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]
