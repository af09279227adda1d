"""Per-request sampling parameters, validated at construction (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

_MAX_LOGPROBS = 20


@dataclass
class StructuredOutputParams:
    """One structured-output constraint; exactly one field is set."""

    json_schema: Optional[dict[str, Any] | str] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None

    def __post_init__(self) -> None:
        chosen = [
            self.json_schema is not None,
            self.json_object,
            self.regex is not None,
            self.choice is not None,
        ]
        if sum(chosen) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json_schema, json_object, regex, choice"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")


@dataclass
class SamplingParams:
    """What to generate and how. Every field is checked in ``__post_init__``;
    a bad value raises ``ValueError`` naming the field and its allowed range."""

    n: int = 1
    best_of: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.best_of is None:
            self.best_of = self.n
        if self.logit_bias is not None:
            # JSON object keys arrive as strings.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError("logit_bias must map token ids to numbers") from None
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_int("best_of", self.best_of, low=self.n)
        _check_range("temperature", self.temperature, 0.0, None)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=None)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=0)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, low=0, high=_MAX_LOGPROBS)
        if self.logit_bias is not None:
            _check_token_ids("logit_bias", list(self.logit_bias))
            for v in self.logit_bias.values():
                _check_range("logit_bias", v, -100.0, 100.0)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            _check_token_ids("allowed_token_ids", self.allowed_token_ids)
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids are only checkable once the model's vocabulary is known."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if self.logit_bias:
            bad = [t for t in self.logit_bias if t >= vocab_size]
            if bad:
                raise ValueError(f"logit_bias contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _check_int(name: str, value: Any, low: Optional[int], high: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_range(name: str, value: Any, low: Optional[float], high: Optional[float]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise ValueError(f"{name} must be in {span}, got {value}")


def _check_token_ids(name: str, ids: Any) -> None:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise ValueError(f"{name} must be a list of non-negative token ids")
