"""Per-request size limits: every field whose size costs the server work.

The body size limit (``--max-body-size``) bounds bytes, not work: 64 KiB of
JSON already holds 10 000 stop strings or a schema nested 5 000 levels (which
the grammar compiler walks recursively). So each costly field has its own
cap, checked at the HTTP edge before anything is tokenized, and each refusal
is a 400 that names the field and states the limit. The defaults are far above
what real clients send (OpenAI itself allows 4 stop strings, 300 logit_bias
entries and n <= 128). The CLI grows one ``--<field>`` option per field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from octavo.openai.errors import bad_request
from octavo.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest


def _limit(default: int | float, help: str, unit: Optional[str] = None) -> Any:
    return field(default=default, metadata={"help": help, **({"unit": unit} if unit else {})})


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = _limit(128, "largest n and best_of (each choice is a sequence the engine decodes)")
    max_prompts: int = _limit(256, "most prompts in one /v1/completions batch")
    max_messages: int = _limit(1024, "most chat messages in one request")
    max_stop: int = _limit(16, "most stop strings")
    max_bad_words: int = _limit(128, "most bad_words")
    max_word_chars: int = _limit(256, "longest stop string or bad word, in characters", unit="characters")
    max_logit_bias: int = _limit(1024, "most logit_bias entries")
    max_token_ids: int = _limit(4096, "most entries in stop_token_ids and in allowed_token_ids")
    max_schema_bytes: int = _limit(64 * 1024, "largest structured-output JSON schema, as compact JSON", unit="bytes")
    max_schema_depth: int = _limit(64, "deepest nesting of a structured-output JSON schema")
    max_regex_chars: int = _limit(4096, "longest structured-output regex", unit="characters")
    max_choices: int = _limit(256, "most structured-output choices")
    max_template_seconds: float = _limit(5.0, "time limit for rendering one chat template", unit="seconds")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")

    def max_items(self, max_model_len: int) -> int:
        """The most items any array or object of a valid request holds: a
        prompt of token ids fills at most the context, each other list its
        own limit, and a JSON schema of ``max_schema_bytes`` has no array of
        more than half as many items (each takes a value and a comma)."""
        return max(max_model_len, self.max_prompts, self.max_messages, self.max_stop, self.max_bad_words,
                   self.max_logit_bias, self.max_token_ids, self.max_choices, self.max_schema_bytes // 2)

    def check(self, req: SamplingFields) -> None:
        """Raise a 400 for the first field of ``req`` over its limit."""
        _at_most("n", req.n, self.max_n)
        _at_most("best_of", getattr(req, "best_of", None), self.max_n)
        if isinstance(req, CompletionRequest) and isinstance(req.prompt, list) and req.prompt:
            if not isinstance(req.prompt[0], int):
                _count("prompt", req.prompt, self.max_prompts, "prompts")
        if isinstance(req, (ChatCompletionRequest, TokenizeRequest)):
            _count("messages", req.messages, self.max_messages, "messages")
        if isinstance(req, ChatCompletionRequest) and req.tools:
            # With tool_choice "required" the tools' schemas become one grammar.
            self._check_schema("tools", [t.function.parameters or {} for t in req.tools])
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        _words("stop", stop, self.max_stop, self.max_word_chars)
        _words("bad_words", req.bad_words, self.max_bad_words, self.max_word_chars)
        _count("logit_bias", req.logit_bias, self.max_logit_bias, "entries")
        _count("stop_token_ids", req.stop_token_ids, self.max_token_ids, "token ids")
        _count("allowed_token_ids", req.allowed_token_ids, self.max_token_ids, "token ids")
        self._check_structured(req)

    def check_messages(self, messages: Optional[list], tools: Optional[list] = None) -> None:
        """/tokenize has messages (and tools) but no sampling fields."""
        _count("messages", messages, self.max_messages, "messages")
        if tools:
            self._check_schema("tools", [t.function.parameters or {} for t in tools])

    def _check_structured(self, req: SamplingFields) -> None:
        fmt, so = req.response_format, req.structured_outputs
        if fmt is not None and fmt.json_schema is not None and fmt.json_schema.json_schema is not None:
            self._check_schema("response_format", fmt.json_schema.json_schema)
        if so is None:
            return
        if so.json_ is not None:
            self._check_schema("structured_outputs", so.json_)
        if so.regex is not None and len(so.regex) > self.max_regex_chars:
            raise bad_request(
                f"structured_outputs.regex has {len(so.regex)} characters, more than the limit of "
                f"{self.max_regex_chars}", "structured_outputs"
            )
        _count("structured_outputs", so.choice, self.max_choices, "choices")

    def _check_schema(self, param: str, schema: Any) -> None:
        if isinstance(schema, str):
            size = len(schema.encode("utf-8", "replace"))
        else:
            size = len(json.dumps(self._shallow(param, schema), separators=(",", ":")))
        if size > self.max_schema_bytes:
            raise bad_request(
                f"{param}: the JSON schema is {size} bytes, more than the limit of {self.max_schema_bytes}", param
            )
        if isinstance(schema, str):
            try:
                self._shallow(param, json.loads(schema))
            except RecursionError:  # deeper than the parser recurses, far over any limit
                self._too_deep(param, "hundreds of")
            except ValueError:
                pass  # StructuredOutputParams names the malformed text

    def _shallow(self, param: str, schema: Any) -> Any:
        depth = nesting_depth(schema)
        if depth > self.max_schema_depth:
            self._too_deep(param, str(depth))
        return schema

    def _too_deep(self, param: str, depth: str) -> None:
        raise bad_request(
            f"{param}: the JSON schema is nested {depth} levels deep, more than the limit of "
            f"{self.max_schema_depth}", param
        )


def nesting_depth(value: Any) -> int:
    """Depth of nested dicts/lists, walked with a stack: a recursive walk is
    exactly what a deep schema is built to break."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _at_most(param: str, value: Optional[int], limit: int) -> None:
    if value is not None and value > limit:
        raise bad_request(f"{param} must be <= {limit} (this server's limit), got {value}", param)


def _count(param: str, items: Optional[Any], limit: int, what: str) -> None:
    if items is not None and len(items) > limit:
        raise bad_request(f"{param} has {len(items)} {what}, more than the limit of {limit}", param)


def _words(param: str, words: Optional[list[str]], limit: int, max_chars: int) -> None:
    _count(param, words, limit, "strings")
    for word in words or ():
        if len(word) > max_chars:
            raise bad_request(f"{param} has a string of {len(word)} characters, more than the limit of {max_chars}", param)
