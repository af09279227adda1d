"""Tool-call readers for one request, and the client's side of their streams."""
from __future__ import annotations

import json
from typing import Any

from octavo.openai.protocol import ChatCompletionRequest
from octavo.server.config import ServerConfig
from octavo.server.tools import ToolOutput, ToolPlan, plan_tools

Call = tuple[str, dict[str, Any]]


def tool_plan(parser: str, functions: list[dict[str, Any]], **fields: Any) -> ToolPlan:
    """The plan of a chat request offering ``functions``, served with ``--tool-call-parser parser``."""
    body = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": f} for f in functions], **fields}
    return plan_tools(ChatCompletionRequest(**body), ServerConfig(enable_auto_tool_choice=True, tool_call_parser=parser))


def calls(tool_calls: Any) -> list[Call]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def assemble(reader: ToolOutput, pieces: list[str]) -> tuple[str | None, list[Call], str | None]:
    """Stream ``pieces`` through ``reader`` and join the deltas the way the openai client does."""
    content, joined, reason = None, {}, None
    for k, piece in enumerate(pieces):
        deltas, reason = reader.delta(piece, "stop" if k == len(pieces) - 1 else None)
        for d in deltas:
            if d.content:
                content = (content or "") + d.content
            for tc in d.tool_calls or []:
                entry = joined.setdefault(tc.index, {"name": "", "arguments": "", "ids": []})
                assert (tc.id is None) == (tc.function.name is None), "a call's first fragment carries id and name"
                if tc.id is not None:
                    assert not entry["ids"] and not entry["arguments"], "name first, then arguments"
                    entry["ids"].append(tc.id)
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    assert sorted(joined) == list(range(len(joined)))
    return content, [(joined[i]["name"], json.loads(joined[i]["arguments"])) for i in sorted(joined)], reason
