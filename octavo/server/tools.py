"""Tool calling on /v1/chat/completions: what ``tool_choice`` asks, and the
calls in the model's output, whole or as stream deltas.

- ``none`` (or no tools): plain text; the tools are still shown to the
  template, as vLLM does.
- ``required`` and a named function: the output is constrained by the
  grammar engine, so the calls are valid against the tools' schemas (unless
  max_tokens cuts them). Named: the output is the function's arguments
  object. Required: a JSON list of {"name", "parameters"} objects, one of
  the tools' schemas each (vLLM's layout); a single item when
  parallel_tool_calls is false.
- ``auto``: the model writes calls in its own format, read back by the
  ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``, as in vLLM).

Streams announce a call (index, id, type, name) once its text is complete,
then send its arguments; a named call streams its arguments as they come.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

from octavo.openai.errors import bad_request
from octavo.openai.protocol import ChatCompletionRequest, ChatMessageOut, FunctionCallOut, NamedToolChoice, ToolCallOut
from octavo.server.config import ServerConfig
from octavo.server.tool_parsers import PARSERS, Parsed, ParsedCall, ToolParser
from octavo.server.tool_parsers.base import call_from_object, decode_json

# What an omitted "parameters" means: a function without arguments.
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How one request treats tools."""

    choice: str  # "none", "auto", "required" or "named"
    functions: list[dict[str, Any]]  # the tools' function objects
    parser: Optional[type[ToolParser]] = None  # auto and required
    named: Optional[str] = None
    schema: Optional[dict[str, Any]] = None  # grammar for required and named
    parallel: bool = True
    # Ids in the served model's form, whichever choice made the call.
    new_call_id: Callable[[], str] = ToolParser.new_call_id

    @property
    def needs_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.needs_special_tokens

    def output(self) -> ToolOutput:
        """The reader of one choice's output."""
        return ToolOutput(self, self.parser(self.functions) if self.parser is not None else None)


def plan_tools(req: ChatCompletionRequest, config: ServerConfig) -> ToolPlan:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> a plan; 400s name the field."""
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
    names = [f["name"] for f in functions]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: the function name {duplicate!r} appears more than once", "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if functions else "none")
    if choice == "none":
        return ToolPlan("none", functions)
    ids = PARSERS[config.tool_call_parser].new_call_id if config.tool_call_parser else ToolParser.new_call_id
    if not functions:
        raise bad_request("tool_choice needs tools: the request has none", "tool_choice")
    parallel = req.parallel_tool_calls
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        return ToolPlan("auto", functions, PARSERS[config.tool_call_parser], parallel=parallel, new_call_id=ids)
    if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs is not None:
        raise bad_request(
            "tool_choice required or a named function constrains the output itself: "
            "it cannot be combined with response_format or structured_outputs",
            "tool_choice",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan("named", functions, named=name, schema=_parameters(functions[names.index(name)]),
                        new_call_id=ids)
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _parameters(f)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return ToolPlan("required", functions, _RequiredCalls, schema=schema, parallel=parallel, new_call_id=ids)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(function.get("parameters") or _NO_PARAMETERS)


class _RequiredCalls(ToolParser):
    """The grammar-constrained layout of tool_choice "required"."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        parsed, pos = Parsed(""), text.find("[") + 1
        while pos > 0:
            value, end = decode_json(text, pos)
            call = call_from_object(value, "parameters")
            if call is None:
                break
            parsed.calls.append(call)
            pos = text.find(",", end) + 1
        return parsed


@dataclass
class ToolMessage:
    content: Optional[str]
    tool_calls: Optional[list[ToolCallOut]]
    finish_reason: Optional[str]


class ToolOutput:
    """One choice's output read for tool calls, whole (``message``) or as it
    streams (``delta``); both read the same parse, so they agree."""

    def __init__(self, plan: ToolPlan, parser: Optional[ToolParser]) -> None:
        self.plan = plan
        self.parser = parser
        self._text = ""  # streamed so far
        self._content_sent = 0
        self._ids: list[str] = []  # one per call announced

    def message(self, text: str, finish_reason: Optional[str]) -> ToolMessage:
        if self.plan.choice == "none":
            return ToolMessage(text, None, finish_reason)
        if self.plan.named is not None:
            calls = [ParsedCall(self.plan.named, text)]
            content = None
        else:
            parsed = self._parse(text, final=True)
            calls, content = parsed.calls, parsed.content or None
        out = [
            ToolCallOut(id=self._id(i), type="function", function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for i, c in enumerate(calls)
        ]
        return ToolMessage(content, out or None, _finish_reason(finish_reason, bool(out)))

    def delta(self, text: str, finish_reason: Optional[str]) -> tuple[list[ChatMessageOut], Optional[str]]:
        """The deltas for ``text`` newly generated (finished when
        ``finish_reason`` is set) and the finish reason to report."""
        if self.plan.choice == "none":
            return [ChatMessageOut(content=text)], finish_reason
        previous, self._text = self._text, self._text + text
        if self.plan.named is not None:
            deltas = [] if previous else [self._announce(0, self.plan.named)]
            if text:
                deltas.append(_arguments(0, text))
            return deltas, _finish_reason(finish_reason, True)
        parsed = self._parse(self._text, final=finish_reason is not None)
        deltas = []
        if len(parsed.content) > self._content_sent:
            deltas.append(ChatMessageOut(content=parsed.content[self._content_sent:]))
            self._content_sent = len(parsed.content)
        for i in range(len(self._ids), len(parsed.calls)):
            deltas += [self._announce(i, parsed.calls[i].name), _arguments(i, parsed.calls[i].arguments)]
        return deltas, _finish_reason(finish_reason, bool(self._ids))

    def _parse(self, text: str, final: bool) -> Parsed:
        assert self.parser is not None  # auto and required plans have one
        parsed = self.parser.parse(text, final)
        if not self.plan.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed

    def _id(self, i: int) -> str:
        while len(self._ids) <= i:
            self._ids.append(self.plan.new_call_id())
        return self._ids[i]

    def _announce(self, i: int, name: str) -> ChatMessageOut:
        call = ToolCallOut(index=i, id=self._id(i), type="function", function=FunctionCallOut(name=name, arguments=""))
        return ChatMessageOut(tool_calls=[call])


def _arguments(i: int, text: str) -> ChatMessageOut:
    return ChatMessageOut(tool_calls=[ToolCallOut(index=i, function=FunctionCallOut(arguments=text))])


def _finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
    # "length" stays: the client must know the calls may be cut short.
    return "tool_calls" if called and reason == "stop" else reason
