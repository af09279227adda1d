"""Per-request sampling parameters, validated at construction (torch-free).

Choices worth knowing:
- ``best_of > n`` needs ``temperature > 0``: greedy candidates would all be the
  same sequence, so ranking them is meaningless. ``n > 1`` with greedy
  decoding (and ``best_of == n``) is allowed and returns n copies.
- ``top_k`` of 0 or -1 turns top-k off; ``max_tokens=0`` is allowed (prompt
  logprobs only); how many ``logprobs`` / ``prompt_logprobs`` a request may
  ask for is the engine's ``max_logprobs`` (20 by default, as vLLM and the
  OpenAI API).
- ``bad_words`` are strings; the engine turns them into token sequences with
  ``resolve_bad_words(tokenizer)`` before the request reaches the sampler.
- ``output_kind``: ``cumulative`` (every step yields the request's output so
  far, for streaming) or ``final_only`` (one output when it finishes; the
  offline ``LLM`` API sets it). With ``final_only`` and no stop strings the
  text is decoded once at the end instead of token by token.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Protocol

_MAX_LOGIT_BIAS = 100.0
_SEED_RANGE = (-(2**63), 2**63 - 1)
# Temperatures below this decode greedily (dividing by them would overflow).
GREEDY_TEMPERATURE = 1e-5


class RequestOutputKind(str, Enum):
    """What each RequestOutput of a request holds (see octavo/outputs.py)."""

    CUMULATIVE = "cumulative"  # everything so far, every step
    DELTA = "delta"  # only what is new since the previous output
    FINAL_ONLY = "final_only"  # one output, when the request ends


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class StructuredOutputParams:
    """One structured-output constraint; exactly one field is set."""

    json_schema: Optional[dict[str, Any] | str] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
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
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json_schema is not valid JSON: {exc}") from None
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise ValueError("structured_outputs.json_schema must be a JSON object (dict) or its text")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Set by resolve_bad_words(); an init field so dataclasses.replace keeps it.
    _bad_words_token_ids: Optional[list[list[int]]] = field(default=None, repr=False)

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
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_int("best_of", self.best_of, low=self.n)
        _check_range("temperature", self.temperature, 0.0, None)
        if self.best_of > self.n and self.greedy:
            raise ValueError(
                f"best_of must equal n ({self.n}) when temperature is 0: greedy candidates are identical"
            )
        _check_range("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, low=-1)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, None)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=_SEED_RANGE[0], high=_SEED_RANGE[1])
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            kinds = ", ".join(k.value for k in RequestOutputKind)
            raise ValueError(f"output_kind must be one of {kinds}; got {self.output_kind!r}") from None
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
                _check_int(name, value, low=0)
        if self.logit_bias is not None:
            _check_token_ids("logit_bias", list(self.logit_bias))
            for v in self.logit_bias.values():
                _check_range("logit_bias", v, -_MAX_LOGIT_BIAS, _MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if not isinstance(self.bad_words, list) or not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise ValueError("bad_words must be a list of strings that are not blank")
        if self._bad_words_token_ids is not None:
            if not isinstance(self._bad_words_token_ids, list):
                raise ValueError("bad_words token ids must be a list of token id lists")
            for ids in self._bad_words_token_ids:
                _check_token_ids("bad_words token ids", ids)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputParams or a dict of its fields")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids are only checkable once the model's vocabulary is known."""
        checks = {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
            "bad_words": [t for ids in self._bad_words_token_ids or [] for t in ids],
        }
        for name, ids in checks.items():
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    def resolve_bad_words(self, tokenizer: _Encoder) -> None:
        """Tokenize ``bad_words`` for the sampler.

        Each word is encoded both as is and with one leading space (as vLLM
        does), because BPE vocabularies spell a word differently at the start
        of the text and after a space. A variant that merely ends with another kept variant is
        dropped: banning the shorter sequence already bans it.
        """
        variants: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in variants:
                    variants.append(ids)
        self._bad_words_token_ids = [
            ids
            for ids in variants
            if not any(o is not ids and len(o) < len(ids) and ids[-len(o):] == o for o in variants)
        ]

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """Token sequences to ban; empty when there are no bad words."""
        if not self.bad_words:
            return []
        if self._bad_words_token_ids is None:
            raise ValueError("bad_words must be tokenized with resolve_bad_words(tokenizer) before sampling")
        return self._bad_words_token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


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
    span = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number in {span}, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be in {span}, got {value}")


def _check_token_ids(name: str, ids: Any) -> None:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise ValueError(f"{name} must be a list of non-negative token ids")
