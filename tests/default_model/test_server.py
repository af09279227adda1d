"""`octavo serve` on the default model, driven by the openai client: plain and streamed chat that
stops at the template's end-of-turn token, structured output, and tool calls the client reads."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.conftest import ServerProcess
from tests.server.test_tool_calling import SCHEMAS, TOOLS, WEATHER

ASK = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    proc = ServerProcess(smollm2, tmp_path_factory.mktemp("logs") / "serve.log", "--served-model-name", MODEL,
                         "--dtype", "bfloat16", "--log-level", "info", api_key=None)
    yield proc
    proc.stop()


def test_chat_answers_and_stops_at_the_end_of_turn(server):
    client = server.openai()
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and "<|im_end|>" not in reply.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reply.choices[0].message.content


def test_structured_output_follows_the_schema(server):
    reply = server.openai().chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_are_valid(server, choice):
    reply = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris for 3 days?"}],
        tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=80, temperature=0)
    [call] = reply.choices[0].message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == WEATHER["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert reply.choices[0].finish_reason == "tool_calls"


def test_start_up_log_says_what_is_served_in_short_lines(server):
    log = server.log()
    assert (f"serving {MODEL} (generate): up to 256 sequences at once, context 8192 tokens; "
            "API key not required") in log
    assert "linear layers: 120 on gguf Q4_1 (int4 group 32)" in log
    long_lines = [line for line in log.splitlines() if " INFO " in line and len(line) > 220]
    assert not long_lines
