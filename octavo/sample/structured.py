"""Structured output: JSON schema, any JSON object, regex or a fixed choice.

The grammar engine is llguidance: a 3 MB wheel with no Python dependencies
whose CPU mask computation (a lazy lexer and Earley parser walking a token
trie) takes microseconds per step. xgrammar does the same job but pulls in
triton and transformers, far too heavy for a CPU-only install.

Lifecycle: one ``GrammarCompiler`` per engine holds the vocabulary as
llguidance sees it; ``compile(spec)`` validates a ``StructuredOutputParams``
(a bad schema or regex is a ``ValueError``) and caches the ``Grammar``;
``grammar.new_matcher()`` gives each request its own state, stored on
``Request.grammar``, on the scheduler side. Every step the engine packs what
each sampling request's matcher allows into a ``GrammarBitmask`` that travels
with the step; on the driver rank ``GrammarBatch`` unpacks it and the sampler
masks the logits; once the tokens are back, the scheduler advances each
matcher by its request's token (``core/step_results.py``). A terminated
matcher (grammar complete, or in error) allows only EOS, so the request ends.

JSON is generated without free whitespace, in ``json.dumps`` style
(", " and ": " separators): free whitespace lets a weak model pad forever,
and this is the layout models see most in training. A schema can override
this through llguidance's "x-guidance" key.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import llguidance
import torch

from octavo.core.outputs import GrammarBitmask
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
_BITS = 32  # llguidance packs the mask into int32 words, token t at bit t % 32 of word t // 32


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(
        self, matcher: llguidance.LLMatcher, executor: llguidance.LLExecutor, vocab_size: int
    ) -> None:
        self._matcher = matcher
        self._executor = executor
        self.vocab_size = vocab_size  # width of the grammar's token mask

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and terminated from then on)
        when the grammar does not allow it."""
        ok = self._matcher.consume_token(token_id)
        if not ok:
            logger.warning("grammar rejected token %d: %s", token_id, self._matcher.get_error())
        return ok

    def is_terminated(self) -> bool:
        """True once nothing but EOS may follow."""
        return self._matcher.is_stopped()


class Grammar:
    """A compiled grammar; cheap to start new matchers from."""

    def __init__(
        self, template: llguidance.LLMatcher, executor: llguidance.LLExecutor, vocab_size: int
    ) -> None:
        self._template = template
        self._executor = executor
        self._vocab_size = vocab_size

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._executor, self._vocab_size)


class GrammarCompiler:
    """Compiles structured-output specs against one tokenizer; build once per engine."""

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
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=eos
        )
        self._executor = llguidance.LLExecutor()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, spec: StructuredOutputParams) -> Grammar:
        """Raises ValueError naming the problem for an invalid schema, regex or choice."""
        if spec.json_schema is not None:
            _check_depth(spec.json_schema)
        # json.dumps, not dataclasses.asdict: asdict deep-copies the schema in
        # Python frames, three per level of nesting.
        key = json.dumps([getattr(spec, f.name) for f in dataclasses.fields(spec)], sort_keys=True)
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
            return grammar
        source = _grammar_source(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self._tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs: {messages[0]}")
        template = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs: {template.get_error()}")
        grammar = self._cache[key] = Grammar(template, self._executor, self.vocab_size)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return grammar


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


def grammar_bitmask(
    request_ids: list[str],
    matchers: list[GrammarMatcher],
    vocab_size: int,
    proposals: Optional[list[list[int]]] = None,
) -> GrammarBitmask:
    """What each matcher allows next, packed for the workers (scheduler side:
    the matchers stay here and advance once the step's tokens are known).
    ``vocab_size`` is the logits' width; bits past a grammar's vocabulary
    stay 0 (forbidden).

    With speculative ``proposals``, request i gets a mask at each of its
    k + 1 verified positions: the matcher walks through the proposals and is
    rolled back after. Past the first proposal its grammar refuses, the masks
    repeat the last valid one: that proposal is masked out, so it is always
    rejected and the later positions are never used."""
    words = -(-max(vocab_size, *(m.vocab_size for m in matchers)) // _BITS)
    proposals = proposals or [[] for _ in matchers]
    counts = [len(p) + 1 for p in proposals]
    starts = list(itertools.accumulate(counts, initial=0))
    bitmask = torch.zeros(starts[-1], words, dtype=torch.int32)
    terminated = {rid for rid, m in zip(request_ids, matchers) if m.is_terminated()}
    terminated_at: dict[str, int] = {}
    valid = [m._matcher.validate_tokens(p) if p else 0 for m, p in zip(matchers, proposals)]
    consumed = [0] * len(matchers)
    executor = matchers[0]._executor
    try:
        for j in range(max(valid) + 1):
            live = [i for i, n in enumerate(valid) if j <= n]
            # One call computes every row's mask, in parallel across rows.
            executor.unsafe_compute_mask_ptr(
                [(matchers[i]._matcher, starts[i] + j) for i in live], bitmask.data_ptr(), words * 4, len(bitmask)
            )
            for i in live:
                if j and request_ids[i] not in terminated_at and matchers[i].is_terminated():
                    terminated_at[request_ids[i]] = j
                if j < valid[i]:
                    matchers[i]._matcher.consume_token(proposals[i][j])
                    consumed[i] += 1
    finally:
        for m, n in zip(matchers, consumed):
            if n:
                m._matcher.rollback(n)
    for i, n in enumerate(valid):
        bitmask[starts[i] + n + 1 : starts[i + 1]] = bitmask[starts[i] + n]
    return GrammarBitmask(
        list(request_ids), words, bitmask.numpy().tobytes(), terminated,
        counts if any(proposals) else None, terminated_at,
    )


@dataclass
class GrammarBatch:
    """The grammar rows of one sampler batch and what their grammars allow next."""

    rows: torch.Tensor  # [R] int64 batch rows that have a grammar
    allowed: torch.Tensor  # [R, V] bool

    @classmethod
    def from_bitmask(
        cls,
        request_ids: Sequence[str],
        shipped: Optional[GrammarBitmask],
        vocab_size: int,
        device: torch.device,
        positions: Optional[Sequence[int]] = None,
    ) -> Optional[GrammarBatch]:
        """The shipped masks of the batch rows ``request_ids`` (at proposal
        ``positions``, when verifying); None when no row has one."""
        if shipped is None:
            return None
        index = shipped.first_rows()
        rows = [row for row, rid in enumerate(request_ids) if rid in index]
        if not rows:
            return None
        packed = torch.frombuffer(bytearray(shipped.bitmask), dtype=torch.int32)
        packed = packed.view(-1, shipped.num_words)
        packed = packed[[index[request_ids[row]] + (positions[row] if positions else 0) for row in rows]]
        shifts = torch.arange(_BITS, dtype=torch.int32)
        bits = (packed.unsqueeze(-1) >> shifts) & 1
        allowed = bits.reshape(len(rows), shipped.num_words * _BITS)[:, :vocab_size].bool()
        return cls(torch.tensor(rows, dtype=torch.int64, device=device), allowed.to(device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Copy of ``logits`` [B, V] with grammar-forbidden tokens at -inf."""
        logits = logits.clone()
        logits[self.rows] = logits[self.rows].masked_fill(~self.allowed, float("-inf"))
        return logits
