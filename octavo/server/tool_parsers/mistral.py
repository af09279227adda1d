"""Mistral: ``[TOOL_CALLS]`` then a JSON list of {"name", "arguments"} (tokenizers
up to v7), or ``name[ARGS]{...}`` / ``name{...}`` after each ``[TOOL_CALLS]`` (v11+)."""
from __future__ import annotations

import re
import secrets
import string

from octavo.server.tool_parsers.base import (
    Parsed,
    ParsedCall,
    ToolParser,
    call_from_object,
    content_before,
    decode_json,
)

_MARK = "[TOOL_CALLS]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.:-]+)\s*(?:\[ARGS\])?")
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens

    def parse(self, text: str, final: bool) -> Parsed:
        content, start = content_before(text, (_MARK,), final)
        parsed = Parsed(content)
        if start < 0:
            return parsed
        segments = text[start:].split(_MARK)[1:]
        for i, segment in enumerate(segments):
            calls = self._segment_calls(segment)
            if calls is None:
                if final:
                    parsed.content += _MARK + _MARK.join(segments[i:])
                break
            parsed.calls += calls
        return parsed

    @staticmethod
    def _segment_calls(segment: str) -> list[ParsedCall] | None:
        """The calls of one segment, None while it is incomplete (or broken)."""
        if segment.lstrip().startswith("["):
            value, _ = decode_json(segment)
            if not isinstance(value, list):
                return None
            calls = [call_from_object(item, "arguments") for item in value]
            return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
        match = _NAME.match(segment)
        if match is None:
            return None
        value, _ = decode_json(segment, match.end())
        call = call_from_object({"name": match.group(1), "arguments": value}, "arguments") if value is not None else None
        return None if call is None else [call]

    @staticmethod
    def new_call_id() -> str:
        # Mistral's templates refuse ids that are not 9 letters and digits.
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
