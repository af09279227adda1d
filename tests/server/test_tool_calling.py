"""Tool calling end to end: `octavo serve` with a published template that
renders tools (Qwen3's, hermes calls), driven by the openai client,
langchain-openai and litellm.

The model has random weights, so what it would write on its own means
nothing: ``required`` and named choices are constrained by the grammar and
must validate against the tools' schemas whatever the weights; ``auto`` is
checked on an output forced by a regex, which the hermes parser must read
back as the call it spells."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import transformers

from tests.model_factory import make_tiny_model
from tests.server.conftest import ServerProcess

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"

# Bounded schemas (enums, ranges, no free extra keys): a random model under
# the grammar ends its JSON within a few dozen tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "metric"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    # The test tokenizer spends ~700 tokens on Qwen3's tool prompt: a longer context than the shared model's.
    return make_tiny_model(tmp_path_factory.mktemp("tool-model"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def tool_server(tool_model, tmp_path_factory):
    srv = ServerProcess(
        tool_model,
        tmp_path_factory.mktemp("logs") / "tools.log",
        "--chat-template", str(TEMPLATE),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--served-model-name", "tiny",
        "--num-blocks", "512",
        api_key=None,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf_tokenizer(tool_model):
    return transformers.AutoTokenizer.from_pretrained(tool_model)


def _check_calls(tool_calls, names=None) -> list[tuple[str, dict]]:
    """Every call names a tool and its arguments validate against that tool's schema."""
    assert tool_calls, "no tool calls"
    calls = []
    for call in tool_calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append((call.function.name, args))
    if names is not None:
        assert [n for n, _ in calls] == names
    return calls


def _stream_calls(client, **kw):
    """The openai client's own assembly of a stream (its stream helper)."""
    with client.chat.completions.stream(model="tiny", **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    return final.choices[0]


@pytest.mark.parametrize("choice,parallel", [(NAMED, True), ("required", False)])
def test_forced_choices_are_valid_and_streams_agree(tool_server, choice, parallel):
    client = tool_server.openai()
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
              max_tokens=120, temperature=0)
    whole = client.chat.completions.create(model="tiny", **kw).choices[0]
    names = ["get_weather"] if choice is NAMED else None
    calls = _check_calls(whole.message.tool_calls, names)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    streamed = _stream_calls(client, **kw)
    assert _check_calls(streamed.message.tool_calls, names) == calls
    assert streamed.finish_reason == "tool_calls"


def test_required_calls_are_valid_under_sampling(tool_server):
    client = tool_server.openai()
    resp = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=1.0, n=4, seed=7,
    )
    for choice in resp.choices:
        assert len(_check_calls(choice.message.tool_calls)) == 1


def _forced(call_text: str) -> dict:
    """structured_outputs that make the model write exactly ``call_text``."""
    return {"structured_outputs": {"regex": re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", call_text).replace("\n", "\\n")}}


def test_auto_reads_the_models_own_call_format(tool_server):
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    client = tool_server.openai()
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0, extra_body=_forced(text))
    whole = client.chat.completions.create(model="tiny", **kw).choices[0]
    assert _check_calls(whole.message.tool_calls) == [("get_time", {"zone": "CET"})]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    streamed = _stream_calls(client, **kw)
    assert _check_calls(streamed.message.tool_calls) == [("get_time", {"zone": "CET"})]
    assert streamed.message.tool_calls[0].id != whole.message.tool_calls[0].id  # fresh per response
    # Raw chunks: the call's first fragment names it, the arguments follow.
    chunks = list(client.chat.completions.create(model="tiny", stream=True, **kw))
    fragments = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert fragments[0].function.name == "get_time" and fragments[0].id and fragments[0].index == 0
    assert "".join(f.function.arguments or "" for f in fragments) == '{"zone": "CET"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_plain_text_stays_content(tool_server):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=30, temperature=0,
              extra_body=_forced("It is sunny."))
    choice = tool_server.openai().chat.completions.create(**kw).choices[0]
    assert choice.message.content == "It is sunny." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def _prompt_tokens(hf, messages, **kw) -> int:
    ids = hf.apply_chat_template(messages, chat_template=TEMPLATE.read_text(), tokenize=True, return_dict=False, **kw)
    return len(ids)


def test_prompts_render_tools_turns_and_template_variables(tool_server, hf_tokenizer):
    """The server's prompt is transformers' rendering: tools offered, a call
    and its result sent back, thinking switched off, a final message continued."""
    client = tool_server.openai()
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60,
                                           temperature=0)
    assert first.usage.prompt_tokens == _prompt_tokens(hf_tokenizer, ASK, tools=TOOLS, add_generation_prompt=True)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sun"}'},
    ]
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=2)
    hf_history = [dict(m) for m in history]
    # What the server hands the template: empty text for no content, arguments as an object.
    hf_history[1] = {**history[1], "content": "", "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}
    expected = _prompt_tokens(hf_tokenizer, hf_history, tools=TOOLS, add_generation_prompt=True)
    assert second.usage.prompt_tokens == expected
    assert second.choices[0].message.tool_calls is None  # tool_choice none: text only

    no_think = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert no_think.usage.prompt_tokens == _prompt_tokens(hf_tokenizer, ASK, add_generation_prompt=True,
                                                          enable_thinking=False)
    partial = ASK + [{"role": "assistant", "content": "The weather in Paris is"}]
    cont = client.chat.completions.create(model="tiny", messages=partial, max_tokens=1,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert cont.usage.prompt_tokens == _prompt_tokens(hf_tokenizer, partial, continue_final_message=True)


@pytest.mark.parametrize("body,param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]}, "messages"),
])
def test_bad_tool_and_template_fields_are_400(tool_server, body, param):
    with tool_server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_auto_needs_the_servers_opt_in(server):
    """vLLM's rule: tools without tool_choice mean "auto", which a server
    without --enable-auto-tool-choice refuses rather than ignoring the tools."""
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        # The model's own template ignores tools; a named choice still gets a valid call.
        ok = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": NAMED,
                                                      "max_tokens": 60, "temperature": 0})
        assert ok.status_code == 200, ok.text
        call = ok.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])


def test_tool_schemas_count_against_the_schema_limit(tuned_server):
    """The tools' parameter schemas become a grammar like any structured-output
    schema, so --max-schema-bytes bounds them too (2000 on this server)."""
    wide = {"type": "function", "function": {"name": "wide", "parameters": {
        "type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(200)}}}}
    with tuned_server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [wide], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "more than the limit of 2000" in r.json()["error"]["message"]


def test_langchain_bind_tools(tool_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=f"{tool_server.url}/v1", api_key="none", temperature=0, max_tokens=120,
                     max_retries=0)
    for choice in ("get_weather", "any"):  # langchain's "any" is OpenAI's "required"
        bound = llm.bind_tools(TOOLS, tool_choice=choice, parallel_tool_calls=False)
        msg = bound.invoke("What is the weather in Paris?")
        assert len(msg.tool_calls) == 1
        jsonschema.validate(msg.tool_calls[0]["args"], SCHEMAS[msg.tool_calls[0]["name"]])
        chunks = list(bound.stream("What is the weather in Paris?"))
        streamed = sum(chunks[1:], chunks[0])
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
            (c["name"], c["args"]) for c in msg.tool_calls]


def test_litellm_tool_calls(tool_server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    import litellm

    kw = dict(model="openai/tiny", api_base=f"{tool_server.url}/v1", api_key="none", messages=ASK, tools=TOOLS,
              tool_choice=NAMED, max_tokens=120, temperature=0)
    resp = litellm.completion(**kw)
    calls = _check_calls(resp.choices[0].message.tool_calls, ["get_weather"])
    chunks = list(litellm.completion(stream=True, **kw))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=ASK)
    assert _check_calls(rebuilt.choices[0].message.tool_calls, ["get_weather"]) == calls


def test_broken_template_fails_at_start_in_one_line(model_path, tmp_path):
    srv = ServerProcess(model_path, tmp_path / "bad.log", "--chat-template", "{% for m in messages %}{{ m }",
                        api_key=None, wait=False)
    assert srv.proc.wait(timeout=120) != 0
    log = srv.log()
    srv.stop()
    assert "--chat-template: chat template is not valid Jinja" in log and "Traceback" not in log, log


def test_tokenize_renders_tools_and_template_fields_as_chat_does(tool_server, hf_tokenizer):
    """/tokenize with messages takes the chat request's template fields (as vLLM's):
    its ids are transformers' rendering, and as many as the chat request's prompt."""
    template = TEMPLATE.read_text()
    cases = [
        ({"tools": TOOLS}, dict(tools=TOOLS, add_generation_prompt=True)),
        ({"chat_template_kwargs": {"enable_thinking": False}}, dict(add_generation_prompt=True, enable_thinking=False)),
        ({"messages": ASK + [{"role": "assistant", "content": "It is"}], "continue_final_message": True,
          "add_generation_prompt": False}, dict(continue_final_message=True)),
    ]
    with tool_server.http() as http:
        for fields, hf_kwargs in cases:
            body = {"model": "tiny", "messages": ASK, **fields}
            tokens = http.post("/tokenize", json=body)
            assert tokens.status_code == 200, tokens.text
            messages = body["messages"]
            expected = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                                        return_dict=False, **hf_kwargs)
            assert tokens.json()["tokens"] == list(expected), fields
            chat = http.post("/v1/chat/completions", json={**body, "max_tokens": 1, "tool_choice": "none"}
                             if "tools" in fields else {**body, "max_tokens": 1})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["prompt_tokens"] == tokens.json()["count"]
        refused = http.post("/tokenize", json={"model": "tiny", "prompt": "hi", "tools": TOOLS})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
