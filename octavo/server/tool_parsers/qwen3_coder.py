"""Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; the tool's JSON schema says what type each is
(typed_values.py). A parameter may end at ``</parameter>``, or where the next
one or the function ends, as models sometimes leave the tag out.
"""
from __future__ import annotations

import json
import re
from typing import Any

from octavo.server.tool_parsers.base import Parsed, ParsedCall, ToolParser, content_before
from octavo.server.tool_parsers.typed_values import typed_value

_MARKERS = ("<tool_call>", "<function=")
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


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
            properties = _properties(self.tools.get(name, {}))
            args = {
                key: typed_value(_strip_newlines(value), properties.get(key, {}))
                for key, value in _PARAMETER.findall(match.group(2))
            }
            parsed.calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
            pos = match.end()
        broken = text.find(_MARKERS[0], pos), text.find(_MARKERS[1], pos)
        if final and max(broken) >= 0:
            # An unfinished call, or markers that never made one: text. Other
            # text after the calls (closing tags, chatter) is dropped, as in vLLM.
            parsed.content += text[min(i for i in broken if i >= 0):]
        return parsed


def _strip_newlines(value: str) -> str:
    # The format puts each value on its own line(s).
    return value.removeprefix("\n").removesuffix("\n")



def _properties(function: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The schemas of a function's parameters; a parameter without a schema
    object (or of a function not among the tools) is a string."""
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict):
        return {}
    return {k: v for k, v in properties.items() if isinstance(v, dict)}
