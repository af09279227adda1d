"""Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; the tool's JSON schema says what type each is.
"""
from __future__ import annotations

import json
import re
from typing import Any

from octavo.server.tool_parsers.base import Parsed, ParsedCall, ToolParser, content_before

_MARKERS = ("<tool_call>", "<function=")
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def parse(self, text: str, final: bool) -> Parsed:
        content, start = content_before(text, _MARKERS, final)
        parsed = Parsed(content)
        if start < 0:
            return parsed
        pos = start
        for match in _FUNCTION.finditer(text, start):
            name = match.group(1)
            schema = (self.tools.get(name, {}).get("parameters") or {}).get("properties", {})
            args = {
                key: _typed(_strip_newlines(value), schema.get(key, {}))
                for key, value in _PARAMETER.findall(match.group(2))
            }
            parsed.calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
            pos = match.end()
        rest = text[pos:].replace("</tool_call>", "").strip()
        if final and (rest or not parsed.calls):
            # An unfinished call, or markers that never made one: text.
            parsed.content += text[pos:] if parsed.calls else text[start:]
        return parsed


def _strip_newlines(value: str) -> str:
    # The format puts each value on its own line(s).
    return value.removeprefix("\n").removesuffix("\n")


def _typed(value: str, schema: dict[str, Any]) -> Any:
    kind = schema.get("type", "string")
    kinds = kind if isinstance(kind, list) else [kind]
    if kinds == ["string"]:
        return value
    if value.strip() == "null" and "null" in kinds:
        return None
    try:
        return json.loads(value)  # numbers, booleans, objects, arrays
    except json.JSONDecodeError:
        return value
