"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""
from __future__ import annotations

from octavo.server.tool_parsers.base import Parsed, ToolParser, call_from_object, content_before, decode_json

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    # <tool_call> is a special token in Hermes' own tokenizers (plain text in Qwen's).
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        content, pos = content_before(text, (_OPEN,), final)
        parsed = Parsed(content)
        while pos >= 0:
            value, end = decode_json(text, pos + len(_OPEN))
            call = call_from_object(value, "arguments")
            if call is None:
                # Unfinished, or not a call after all; at the end its text is content.
                if final:
                    parsed.content += text[pos:]
                break
            parsed.calls.append(call)
            close = text.find(_CLOSE, end)
            pos = text.find(_OPEN, close + len(_CLOSE) if close >= 0 else end)
        return parsed
