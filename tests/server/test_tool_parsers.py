"""The per-choice reader of tool calls (octavo/server/tools.py): what tool_choice asks,
call ids, and the requests refused. The parsers' outputs: test_tool_parsers_outputs.py.

No server: the parsers and the reader are plain functions of the generated text."""
from __future__ import annotations

import pytest

from octavo.openai.errors import APIError
from octavo.openai.protocol import ChatCompletionRequest
from octavo.server.config import ServerConfig
from octavo.server.tool_parsers import PARSERS
from octavo.server.tools import plan_tools
from tests.server.tool_streams import assemble, calls, tool_plan

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
PARIS = ("get_weather", {"city": "Paris", "days": 3})
TWO_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                   '{"name": "get_time", "parameters": {"zone": "Europe/Rome"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
               '{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                   "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
}


def _plan(parser: str, **fields):
    return tool_plan(parser, [WEATHER, TIME], **fields)


@pytest.mark.parametrize("parser", sorted(TWO_CALLS))
def test_calls_get_ids_in_the_models_form(parser):
    message = _plan(parser).output().message(TWO_CALLS[parser], "stop")
    ids = [c.id for c in message.tool_calls]
    assert len(ids) == 2 and len(set(ids)) == 2
    if parser == "mistral":  # Mistral's templates accept only 9 letters and digits
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("call_") for i in ids)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = TWO_CALLS["hermes"]
    plan = _plan("hermes", parallel_tool_calls=False)
    assert calls(plan.output().message(text, "stop").tool_calls) == [PARIS]
    assert assemble(plan.output(), [text[:40], text[40:]])[1] == [PARIS]


def test_named_choice_streams_arguments_as_they_come():
    plan = _plan("hermes", tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert plan.schema == TIME["parameters"] and plan.parser is None
    reader = plan.output()
    first, _ = reader.delta('{"zone": ', None)
    assert [(d.tool_calls[0].function.name, d.tool_calls[0].function.arguments) for d in first] == [("get_time", ""), (None, '{"zone": ')]
    second, reason = reader.delta('"UTC"}', "stop")
    assert second[0].tool_calls[0].function.arguments == '"UTC"}' and reason == "tool_calls"
    whole = plan.output().message('{"zone": "UTC"}', "stop")
    assert calls(whole.tool_calls) == [("get_time", {"zone": "UTC"})] and whole.content is None


def test_required_choice_grammar_and_layout():
    plan = _plan("hermes", tool_choice="required", parallel_tool_calls=False)
    assert plan.schema["maxItems"] == 1 and plan.schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in plan.schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
    assert calls(plan.output().message(text, "stop").tool_calls) == [PARIS]
    assert assemble(plan.output(), list(text))[1] == [PARIS]


@pytest.mark.parametrize("fields,config,param,words", [
    ({"tool_choice": "auto"}, {}, "tool_choice", "--enable-auto-tool-choice"),
    ({}, {}, "tool_choice", "--enable-auto-tool-choice"),  # tools without tool_choice mean auto
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, {}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, {}, "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": WEATHER}] * 2}, {}, "tools", "more than once"),
    ({"tools": None, "tool_choice": "required"}, {}, "tool_choice", "needs tools"),
])
def test_tool_requests_refused_name_the_field(fields, config, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": WEATHER}], **fields}
    with pytest.raises(APIError) as exc:
        plan_tools(ChatCompletionRequest(**body), ServerConfig(**config))
    assert exc.value.status == 400 and exc.value.param == param and words in exc.value.message


def test_parsers_share_one_interface():
    assert set(PARSERS) >= {"hermes", "llama3_json", "mistral", "qwen3_coder"}
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="nope")
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
