"""A parameter written as raw text -> the value its JSON schema's type says.

Formats such as Qwen3-Coder's XML carry every value as text; the tool's
schema is the only word on whether ``3`` is a number or a string. Text
that does not read as its type stays the text: a call with a wrong value
reaches the client, who can see it, rather than a guessed one.
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Callable

_INTEGER = re.compile(r"[-+]?\d+", re.ASCII)
_DECIMAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", re.ASCII)
_MISS = object()  # a converter's "not of my type"


def typed_value(text: str, schema: dict[str, Any]) -> Any:
    """``text`` as the first of the schema's types it reads as, else ``text``."""
    kind = schema.get("type", "string")
    kinds = kind if isinstance(kind, list) else [kind]
    converters = [_CONVERTERS[k] for k in kinds if isinstance(k, str) and k in _CONVERTERS]
    raw = text.strip()
    # An optional parameter left empty; a string parameter keeps the word.
    if raw.lower() == "null" and (converters or "null" in kinds):
        return None
    for convert in converters:
        value = convert(raw)
        if value is not _MISS:
            return value
    return text


def _integer(raw: str) -> Any:
    if not _INTEGER.fullmatch(raw):
        return _MISS
    try:
        return int(raw)
    except ValueError:  # beyond Python's digit limit for int()
        return _MISS


def _number(raw: str) -> Any:
    if _INTEGER.fullmatch(raw):
        return _integer(raw)  # as written: 3 stays 3, not 3.0
    if not _DECIMAL.fullmatch(raw):
        return _MISS
    value = float(raw)
    return value if math.isfinite(value) else _MISS  # JSON has no inf


def _boolean(raw: str) -> Any:
    # Models trained on Python write True/False as often as JSON's true/false.
    return {"true": True, "false": False}.get(raw.lower(), _MISS)


def _container(kind: type) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            try:  # Python's spelling: single quotes, True, None
                value = ast.literal_eval(raw)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return _MISS
        except RecursionError:  # nested deeper than the decoder goes
            return _MISS
        if not isinstance(value, kind):
            return _MISS
        try:
            json.dumps(value, allow_nan=False)  # a literal may hold what JSON cannot
        except (TypeError, ValueError):
            return _MISS
        return value

    return convert


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "object": _container(dict),
    "array": _container(list),
}
