"""Tool-call parsers by name (``--tool-call-parser``)."""
from __future__ import annotations

from octavo.server.tool_parsers.base import Parsed, ParsedCall, ToolParser
from octavo.server.tool_parsers.hermes import HermesParser
from octavo.server.tool_parsers.llama3_json import Llama3JsonParser
from octavo.server.tool_parsers.mistral import MistralParser
from octavo.server.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser)
}

__all__ = ["PARSERS", "Parsed", "ParsedCall", "ToolParser"]
