"""Llama 3.1-3.3 JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}``
or ``{"name": ..., "arguments": {...}}`` (optionally after ``<|python_tag|>``),
several separated by ``;``."""
from __future__ import annotations

from octavo.server.tool_parsers.base import Parsed, ToolParser, call_from_object, decode_json

_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|>

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(_TAG):
            body = body[len(_TAG):]
        elif not body.startswith("{"):
            # Calls come first or not at all: this is an answer in words,
            # unless what there is so far may still become a call.
            maybe_call = not final and _TAG.startswith(body)  # "" (only spaces so far) too
            return Parsed("" if maybe_call else text)
        parsed, pos = Parsed(""), 0
        while True:
            value, end = decode_json(body, pos)
            # Llama 3.x writes either key (vLLM reads "arguments" first); an object
            # with neither is an answer in JSON, not a call.
            call = call_from_object(value, "arguments", "parameters", required=True)
            if call is None:
                break
            parsed.calls.append(call)
            pos = end
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        if final and body[pos:].strip():
            # Not (only) calls: with none found it was all an answer in JSON.
            parsed.content = body[pos:] if parsed.calls else text
        return parsed
