"""/v1/responses through the official openai client: the same text as chat
completions for the same conversation (greedy), streamed events in the
API's order, and 400s that name the field."""
from __future__ import annotations

import json

import jsonschema
import pytest

MODEL = "tiny"
SYSTEM = "You write short answers."
QUESTION = "The quick brown fox"


def _chat(client, messages, max_tokens):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def test_text_matches_chat_completions(server):
    client = server.openai()
    r = client.responses.create(model=MODEL, input=QUESTION, instructions=SYSTEM, max_output_tokens=12,
                                temperature=0, metadata={"run": "a"}, store=False)
    chat = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 12)
    assert r.object == "response" and r.model == MODEL and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    finished = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finished == "length" else "completed")
    if finished == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.metadata == {"run": "a"} and r.instructions == SYSTEM and r.store is False


def test_message_items_with_text_parts(server):
    """Items as the API writes them: input_text parts, an assistant turn sent
    back with output_text, a developer turn (a system turn for templates)."""
    client = server.openai()
    items = [
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi there.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=10, temperature=0)
    chat = _chat(client, [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."}, {"role": "user", "content": QUESTION},
    ], 10)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_in_order(server):
    client = server.openai()
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert deltas and "".join(e.delta for e in deltas) == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    item_id = events[2].item.id
    assert {e.item_id for e in deltas} == {item_id} and events[-1].response.output[0].id == item_id
    assert events[-4].text == whole.output_text and events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}


def test_stream_helper_assembles_the_response(server):
    """The client's own accumulator checks that each event fits the snapshot
    so far. Its final response needs response.completed (it has no place for
    response.incomplete), so the output is a schema's, which completes."""
    client = server.openai()
    kw = dict(model=MODEL, input="A person as JSON", max_output_tokens=60, temperature=0, text=PERSON)
    with client.responses.stream(**kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == client.responses.create(**kw).output_text


def test_json_schema_text_format(server):
    r = server.openai().responses.create(model=MODEL, input="A person as JSON", max_output_tokens=60,
                                         temperature=0, text=PERSON)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("body,param,words", [
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools", "not supported"),
    ({"input": "x", "store": True}, "store", "keeps no responses"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": "word " * 600}, "input", "maximum context length"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature", "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text", "schema"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input", ""),
])
def test_bad_requests_name_the_field(server, body, param, words):
    with server.http() as http:
        r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].split(".")[0] == param, error
    assert words in error["message"]
