"""The tool-call parser interface: a model's text -> content and tool calls.

Models announce tool calls in their own formats (Hermes' ``<tool_call>``
tags, Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``, Qwen3-Coder's XML).
A parser reads the text generated so far and says what of it is content
and which calls are complete. It is called on the whole text at every
stream step (``final=False``) and once at the end (``final=True``): the
same function serves both modes, so a stream and a non-streamed answer
hold the same calls. A call counts once its text is complete (its JSON
closed), which is what lets a stream announce it without ever taking it
back; a call cut short by max_tokens stays content, in both modes.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

_DECODER = json.JSONDecoder()

@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text

@dataclass
class Parsed:
    """What the text so far holds. ``content`` only grows from one call to
    the next on a growing text (text that may still turn into a call is held
    back until it is clear)."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)

class ToolParser(ABC):
    """One request's parser; ``tools`` are the request's tool definitions
    (the ``function`` objects), for formats that need the schemas."""

    name: ClassVar[str]
    # Markers that are special tokens, which the detokenizer would otherwise drop.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = {t["name"]: t for t in tools}

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """Content and complete calls in ``text``; with ``final`` the text is
        all there will be, so nothing is held back."""

    @staticmethod
    def new_call_id() -> str:
        """An id for a call this model made (some templates check their form)."""
        return f"call_{uuid.uuid4().hex[:24]}"

def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of ``text``'s longest tail that could be the start of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest

def content_before(text: str, markers: tuple[str, ...], final: bool) -> tuple[str, int]:
    """(content, index of the first marker or -1): the text before the first
    marker, less a tail that may be a marker's start when not ``final``."""
    starts = [i for i in (text.find(m) for m in markers) if i >= 0]
    if starts:
        first = min(starts)
        return text[:first], first
    if final:
        return text, -1
    return text[: len(text) - held_back(text, markers)], -1

def decode_json(text: str, pos: int = 0) -> tuple[Optional[Any], int]:
    """(value, end) for a complete JSON value at ``text[pos:]`` after
    whitespace; (None, pos) when it is incomplete or not JSON."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None, pos

def call_from_object(value: Any, *keys: str, required: bool = False) -> Optional[ParsedCall]:
    """{"name": ..., <key>: {...}} -> a call, the arguments under the first of
    ``keys`` the object has; without any of them the call has no arguments,
    or is no call when ``required``. None for any other shape."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in keys if k in value), None)
    if key is None and required:
        return None
    args = value[key] if key is not None else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))
