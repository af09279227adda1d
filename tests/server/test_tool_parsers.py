"""Tool-call parsers on fixed model outputs, and streams that agree with whole answers.

No server: the parsers and the per-choice reader (octavo/server/tools.py)
are plain functions of the generated text."""
from __future__ import annotations

import json
import random

import pytest

from octavo.openai.errors import APIError
from octavo.openai.protocol import ChatCompletionRequest
from octavo.server.config import ServerConfig
from octavo.server.tool_parsers import PARSERS
from octavo.server.tools import ToolOutput, plan_tools

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
ROME = ("get_time", {"zone": "Europe/Rome"})

# parser -> [(model output, expected content, expected calls)]
SAMPLES: dict[str, list[tuple[str, str | None, list[tuple[str, dict]]]]] = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>', None, [PARIS]),
        ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}\n</tool_call>',
         "Let me check. ", [PARIS, ROME]),
        ("It is sunny in <b>Paris</b>; no <tool_ tags here.", "It is sunny in <b>Paris</b>; no <tool_ tags here.", []),
        # Cut short by max_tokens: the unfinished call stays text.
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '<tool_call>\n{"name": "get_weather", '
         '"arguments": {"city": "Par', []),
        # No closing tag (a stop string ate it): the JSON is complete, so is the call.
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}', None, [ROME]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
         '{"name": "get_time", "parameters": {"zone": "Europe/Rome"}}', None, [PARIS, ROME]),
        # Llama 3.x writes "arguments" as often as "parameters".
        ('{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}', None, [ROME]),
        ("  The weather is fine.", "  The weather is fine.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
        # A name but neither key: an answer in JSON, not a call.
        ('{"name": "Ada", "born": 1815}', '{"name": "Ada", "born": 1815}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}]', None, [PARIS, ROME]),
        ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time{"zone": "Europe/Rome"}',
         "Sure.", [PARIS, ROME]),
        ("No calls [TOOL", "No calls [TOOL", []),
    ],
    "qwen3_coder": [
        ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Checking.\n", [PARIS]),
        ("<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Rome\n</parameter>\n</function>\n</tool_call>"
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n</function>\n</tool_call>", None, [ROME, PARIS]),
        # Typed by the schema: Python's True is the boolean, a string stays a string.
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n<parameter=metric>\nTrue\n"
         "</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": "1984", "metric": True})]),
        ("<tool_call>\n<function=get_time>\n<parameter=zone>\nEur", "<tool_call>\n<function=get_time>\n<parameter=zone>\nEur", []),
    ],
}
CASES = [(name, *sample) for name, samples in SAMPLES.items() for sample in samples]


def _plan(parser: str, **fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)],
            **fields}
    return plan_tools(ChatCompletionRequest(**body), ServerConfig(enable_auto_tool_choice=True, tool_call_parser=parser))


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parser_reads_fixed_outputs(parser, text, content, calls):
    message = _plan(parser).output().message(text, "stop")
    assert message.content == content
    assert _calls(message.tool_calls) == calls
    assert message.finish_reason == ("tool_calls" if calls else "stop")
    ids = [c.id for c in message.tool_calls or []]
    assert len(set(ids)) == len(ids)
    if parser == "mistral":  # Mistral's templates accept only 9 letters and digits
        assert all(len(i) == 9 and i.isalnum() for i in ids)


def _assemble(reader: ToolOutput, pieces: list[str]) -> tuple[str | None, list[tuple[str, dict]], str | None]:
    """Stream ``pieces`` through ``reader`` and join the deltas the way the openai client does."""
    content, calls, reason = None, {}, None
    for k, piece in enumerate(pieces):
        deltas, reason = reader.delta(piece, "stop" if k == len(pieces) - 1 else None)
        for d in deltas:
            if d.content:
                content = (content or "") + d.content
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "ids": []})
                assert (tc.id is None) == (tc.function.name is None), "a call's first fragment carries id and name"
                if tc.id is not None:
                    assert not entry["ids"] and not entry["arguments"], "name first, then arguments"
                    entry["ids"].append(tc.id)
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], reason


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streams_agree_with_whole_answers(parser, text, content, calls):
    rng = random.Random(0)
    splits = [list(text)]  # one character at a time
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        got_content, got_calls, reason = _assemble(_plan(parser).output(), pieces)
        assert (got_content, got_calls) == (content, calls)
        assert reason == ("tool_calls" if calls else "stop")


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = SAMPLES["hermes"][1][0]
    plan = _plan("hermes", parallel_tool_calls=False)
    assert _calls(plan.output().message(text, "stop").tool_calls) == [PARIS]
    assert _assemble(plan.output(), [text[:40], text[40:]])[1] == [PARIS]


def test_named_choice_streams_arguments_as_they_come():
    plan = _plan("hermes", tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert plan.schema == TIME["parameters"] and plan.parser is None
    reader = plan.output()
    first, _ = reader.delta('{"zone": ', None)
    assert [(d.tool_calls[0].function.name, d.tool_calls[0].function.arguments) for d in first] == [("get_time", ""), (None, '{"zone": ')]
    second, reason = reader.delta('"UTC"}', "stop")
    assert second[0].tool_calls[0].function.arguments == '"UTC"}' and reason == "tool_calls"
    whole = plan.output().message('{"zone": "UTC"}', "stop")
    assert _calls(whole.tool_calls) == [("get_time", {"zone": "UTC"})] and whole.content is None


def test_required_choice_grammar_and_layout():
    plan = _plan("hermes", tool_choice="required", parallel_tool_calls=False)
    assert plan.schema["maxItems"] == 1 and plan.schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in plan.schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
    assert _calls(plan.output().message(text, "stop").tool_calls) == [PARIS]
    assert _assemble(plan.output(), list(text))[1] == [PARIS]


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
