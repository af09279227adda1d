"""Every tool-call parser on a table of outputs as the models write them, whole and
streamed: split at every character position, a stream holds the same content and calls
as the non-streamed answer. Where Octavo reads an output differently from vLLM the row
says so (docs/SERVING.md, Tool calling, lists the differences)."""
from __future__ import annotations

import random

import pytest

from octavo.server.tool_parsers import PARSERS
from tests.server.tool_streams import Call, assemble, calls, tool_plan

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
    "min_score": {"type": "number"}, "filters": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
    "code": {"type": "string"}}}}
TOOLS = [WEATHER, TIME, SEARCH]

PARIS: Call = ("get_weather", {"city": "Paris", "days": 3})
ROME: Call = ("get_time", {"zone": "Europe/Rome"})
NESTED: Call = ("search", {"query": "llm serving", "filters": {"year": {"gte": 2023}, "lang": ["en", "de"]}})

H_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
H_ROME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}\n</tool_call>'
L_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
Q_PARIS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
           "</parameter>\n</function>\n</tool_call>")
Q_ROME = "<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Rome\n</parameter>\n</function>\n</tool_call>"

# (parser, model output, content, calls), one pytest id each
ROWS = [
    # Hermes 2/3, Qwen2.5, Qwen3
    pytest.param("hermes", H_PARIS, None, [PARIS], id="hermes-one-call"),
    pytest.param("hermes", f"<think>\nWeather and time, two calls.\n</think>\n\n{H_PARIS}\n{H_ROME}",
                 "<think>\nWeather and time, two calls.\n</think>\n\n", [PARIS, ROME], id="hermes-qwen3-thinking-two-calls"),
    pytest.param("hermes", f"Let me check. {H_PARIS}\nOne moment.", "Let me check. ", [PARIS],
                 id="hermes-text-after-calls-dropped-as-vllm"),
    pytest.param("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"Europe/Rome\\"}"}\n</tool_call>',
                 None, [ROME], id="hermes-arguments-as-json-string"),
    pytest.param("hermes", '<tool_call>\n{"name": "search", "arguments": {"query": "llm serving", "filters": '
                 '{"year": {"gte": 2023}, "lang": ["en", "de"]}}}\n</tool_call>', None, [NESTED], id="hermes-nested"),
    pytest.param("hermes", "It is sunny in <b>Paris</b>; no <tool_ tags here.",
                 "It is sunny in <b>Paris</b>; no <tool_ tags here.", [], id="hermes-plain-text"),
    pytest.param("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', [],
                 id="hermes-malformed-json"),
    pytest.param("hermes", "<tool_call>\n{'name': 'get_time', 'arguments': {'zone': 'UTC'}}\n</tool_call>",
                 "<tool_call>\n{'name': 'get_time', 'arguments': {'zone': 'UTC'}}\n</tool_call>", [],
                 id="hermes-python-dict"),
    pytest.param("hermes", f'{H_PARIS}\n<tool_call>\n{{"name": "get_time", "arguments": {{"zone": Rome}}}}\n</tool_call>',
                 '<tool_call>\n{"name": "get_time", "arguments": {"zone": Rome}}\n</tool_call>', [PARIS],
                 id="hermes-second-call-malformed-first-kept-unlike-vllm"),
    pytest.param("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', [], id="hermes-cut-by-max-tokens"),
    pytest.param("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}', None, [ROME],
                 id="hermes-closing-tag-eaten-by-stop"),
    # Llama 3.1 / 3.2 / 3.3
    pytest.param("llama3_json", L_PARIS, None, [PARIS], id="llama3-parameters"),
    pytest.param("llama3_json", '{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}', None, [ROME],
                 id="llama3-arguments"),
    pytest.param("llama3_json", f'<|python_tag|>{L_PARIS}; {{"name": "get_time", "arguments": {{"zone": "Europe/Rome"}}}}',
                 None, [PARIS, ROME], id="llama3-python-tag-two-calls-both-keys"),
    pytest.param("llama3_json", '{"name": "search", "parameters": {"query": "llm serving", "filters": '
                 '{"year": {"gte": 2023}, "lang": ["en", "de"]}}}', None, [NESTED], id="llama3-nested"),
    pytest.param("llama3_json", f"{L_PARIS}\nThis looks up the weather.", "This looks up the weather.", [PARIS],
                 id="llama3-text-after-calls-kept-unlike-vllm"),
    pytest.param("llama3_json", f"Sure! {L_PARIS}", f"Sure! {L_PARIS}", [], id="llama3-text-before-is-an-answer-unlike-vllm"),
    pytest.param("llama3_json", "  The weather is fine.", "  The weather is fine.", [], id="llama3-plain-text"),
    pytest.param("llama3_json", '{"answer": 42}', '{"answer": 42}', [], id="llama3-json-answer"),
    pytest.param("llama3_json", '{"name": "Ada", "born": 1815}', '{"name": "Ada", "born": 1815}', [],
                 id="llama3-named-object-without-arguments"),
    pytest.param("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}',
                 '{"name": "get_weather", "parameters": {"city": "Paris"}', [], id="llama3-malformed-json"),
    pytest.param("llama3_json", "{'name': 'get_time', 'parameters': {'zone': 'UTC'}}",
                 "{'name': 'get_time', 'parameters': {'zone': 'UTC'}}", [], id="llama3-python-dict"),
    # Mistral, Mixtral, Nemo, Small
    pytest.param("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                 '{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}]', None, [PARIS, ROME], id="mistral-v3-list"),
    pytest.param("mistral", 'Let me look.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}]',
                 "Let me look.", [ROME], id="mistral-v3-text-before"),
    pytest.param("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time'
                 '{"zone": "Europe/Rome"}', "Sure.", [PARIS, ROME], id="mistral-v11-two-markers"),
    pytest.param("mistral", '[TOOL_CALLS]search[ARGS]{"query": "llm serving", "filters": {"year": {"gte": 2023}, '
                 '"lang": ["en", "de"]}}', None, [NESTED], id="mistral-v11-nested"),
    pytest.param("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}]\nDone.', None,
                 [ROME], id="mistral-text-after-calls-dropped-as-vllm"),
    pytest.param("mistral", "No calls [TOOL", "No calls [TOOL", [], id="mistral-plain-text"),
    pytest.param("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',
                 '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]', [], id="mistral-malformed-json"),
    pytest.param("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
                 '{"zone": Rome}', '[TOOL_CALLS]get_time[ARGS]{"zone": Rome}', [PARIS],
                 id="mistral-second-call-malformed-first-kept"),
    # Qwen3-Coder
    pytest.param("qwen3_coder", f"Checking.\n{Q_PARIS}", "Checking.\n", [PARIS], id="qwen3c-text-before"),
    pytest.param("qwen3_coder", Q_ROME + Q_PARIS, None, [ROME, PARIS], id="qwen3c-two-calls"),
    pytest.param("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n"
                 "<parameter=limit>\n10\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=min_score>\n"
                 "0.75\n</parameter>\n<parameter=filters>\n{'year': 2024, 'open': False}\n</parameter>\n"
                 '<parameter=tags>\n["a", "b"]\n</parameter>\n</function>\n</tool_call>', None,
                 [("search", {"query": "42", "limit": 10, "exact": True, "min_score": 0.75,
                              "filters": {"year": 2024, "open": False}, "tags": ["a", "b"]})], id="qwen3c-typed-by-schema"),
    pytest.param("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=code>\ndef less(a, b):\n"
                 "    return a < b\n\n</parameter>\n</function>\n</tool_call>", None,
                 [("search", {"code": "def less(a, b):\n    return a < b\n"})], id="qwen3c-multiline-code"),
    pytest.param("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\nthree\n</parameter>\n<parameter=metric>\nmaybe\n</parameter>\n</function>\n</tool_call>",
                 None, [("get_weather", {"city": "Paris", "days": "three", "metric": "maybe"})],
                 id="qwen3c-not-of-its-type-stays-text-unlike-vllm-boolean"),
    pytest.param("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n"
                 "</function>\n</tool_call>", None, [PARIS], id="qwen3c-parameter-tags-left-open"),
    pytest.param("qwen3_coder", "<tool_call>\n<function=lookup>\n<parameter=id>\n7\n</parameter>\n</function>\n"
                 "</tool_call>", None, [("lookup", {"id": "7"})], id="qwen3c-unknown-function-strings"),
    pytest.param("qwen3_coder", "<function=get_time>\n<parameter=zone>\nEurope/Rome\n</parameter>\n</function>", None,
                 [ROME], id="qwen3c-without-tool-call-tag"),
    pytest.param("qwen3_coder", f"{Q_ROME}\nDone.", None, [ROME], id="qwen3c-text-after-calls-dropped-as-vllm"),
    pytest.param("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\nEur",
                 "<tool_call>\n<function=get_time>\n<parameter=zone>\nEur", [], id="qwen3c-cut-by-max-tokens"),
    pytest.param("qwen3_coder", f"{Q_ROME}\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                 "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [ROME], id="qwen3c-second-call-cut"),
    pytest.param("qwen3_coder", "Use <tool_call> tags, e.g. <function=name>.",
                 "Use <tool_call> tags, e.g. <function=name>.", [], id="qwen3c-markers-in-prose"),
]


def test_every_parser_has_rows():
    assert {row.values[0] for row in ROWS} == set(PARSERS)


@pytest.mark.parametrize("parser,text,content,expected", ROWS)
def test_whole_answer(parser: str, text: str, content: str | None, expected: list[Call]) -> None:
    message = tool_plan(parser, TOOLS).output().message(text, "stop")
    assert message.content == content
    assert calls(message.tool_calls) == expected
    assert message.finish_reason == ("tool_calls" if expected else "stop")


@pytest.mark.parametrize("parser,text,content,expected", ROWS)
def test_streams_agree_at_every_split(parser: str, text: str, content: str | None, expected: list[Call]) -> None:
    rng = random.Random(0)
    splits = [[text[:k], text[k:]] for k in range(1, len(text))]
    splits.append(list(text))  # a token per character
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        got_content, got_calls, reason = assemble(tool_plan(parser, TOOLS).output(), pieces)
        assert (got_content, got_calls) == (content, expected), pieces
        assert reason == ("tool_calls" if expected else "stop")
