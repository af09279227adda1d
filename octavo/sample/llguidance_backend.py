"""The llguidance structured-output backend: JSON schema, any JSON object,
regex or a fixed choice.

llguidance is a 3 MB wheel with no Python dependencies whose CPU mask
computation (a lazy lexer and Earley parser walking a token trie) takes
microseconds per step. xgrammar does the same job but pulls in triton and
transformers, far too heavy for a CPU-only install.

The backend holds the vocabulary as llguidance sees it and caches compiled
grammars; each sequence gets its own copy of the compiled matcher. A schema,
regex or choice llguidance refuses is a ``ValueError``.

JSON is generated without free whitespace, in ``json.dumps`` style
(", " and ": " separators): free whitespace lets a weak model pad forever,
and this is the layout models see most in training. A schema can override
this through llguidance's "x-guidance" key.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence

import llguidance
import torch

from octavo.core.structured_output import StructuredOutputBackend, StructuredOutputGrammar
from octavo.sampling_params import StructuredOutputParams

if TYPE_CHECKING:  # the engine layer sits above this one: no runtime import
    from octavo.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Levels of JSON objects/arrays allowed in a schema. llguidance's JSON reader
# stops at 128 (serde_json's limit), counting the few levels it wraps the
# schema in; 120 stays clear of that. A nested object schema costs two
# levels per property level ({"properties": {"a": {...}}}).
MAX_SCHEMA_DEPTH = 120


class LLGuidanceGrammar(StructuredOutputGrammar):
    """One sequence's llguidance matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for token_id in token_ids:
            if not self.matcher.consume_token(token_id):
                logger.warning("grammar rejected token %d: %s", token_id, self.matcher.get_error())
                return False
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return self.matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def reset(self) -> None:
        self.matcher.reset()


class LLGuidanceBackend(StructuredOutputBackend):
    """Compiles structured-output specs against one tokenizer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Optional[list[int]] = None,
        cache_size: int = 128,
    ) -> None:
        eos = eos_token_ids or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        if not eos:
            raise ValueError("structured output needs an EOS token: the tokenizer defines none")
        # The model's vocabulary may be padded past the tokenizer's; the extra
        # ids decode to nothing, so llguidance never allows them.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        # llguidance reads the vocabulary (and how tokens map to bytes) from
        # the tokenizer.json text itself.
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=eos)
        self._executor = llguidance.LLExecutor()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, spec: StructuredOutputParams) -> LLGuidanceGrammar:
        if spec.json_schema is not None:
            _check_depth(spec.json_schema)
        # json.dumps, not dataclasses.asdict: asdict deep-copies the schema in
        # Python frames, three per level of nesting.
        key = json.dumps([getattr(spec, f.name) for f in dataclasses.fields(spec)], sort_keys=True)
        template = self._cache.get(key)
        if template is not None:
            self._cache.move_to_end(key)
        else:
            template = self._cache[key] = self._compile(spec)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return LLGuidanceGrammar(template.deep_copy(), self.vocab_size)

    def _compile(self, spec: StructuredOutputParams) -> llguidance.LLMatcher:
        source = _grammar_source(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self._tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs: {messages[0]}")
        template = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs: {template.get_error()}")
        return template

    def fill_bitmasks(self, bitmask: torch.Tensor, rows: Sequence[tuple[StructuredOutputGrammar, int]]) -> None:
        """One executor call computes every row's mask, in parallel across rows."""
        matchers = []
        for grammar, row in rows:
            assert isinstance(grammar, LLGuidanceGrammar), "a grammar of another backend"
            matchers.append((grammar.matcher, row))
        if matchers:
            self._executor.unsafe_compute_mask_ptr(
                matchers, bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size(), len(bitmask)
            )


def _check_depth(schema: object) -> None:
    """Refuse schemas nested deeper than MAX_SCHEMA_DEPTH objects/arrays.

    Deeper ones fail anyway (in llguidance, with a cryptic message), and past a few hundred levels Python's own recursion
    limit turns them into RecursionError, which would take the engine down.
    Counted with an explicit stack, so any depth is safe to measure."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"structured_outputs.json_schema is too deeply nested: more than {MAX_SCHEMA_DEPTH} "
                "levels of objects and arrays"
            )
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _grammar_source(spec: StructuredOutputParams) -> str:
    matcher = llguidance.LLMatcher
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # Lark string literals use JSON's escaping.
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    schema = {"type": "object"} if spec.json_object else spec.json_schema
    try:
        return matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json_schema: {exc}") from None
