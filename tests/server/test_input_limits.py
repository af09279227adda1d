"""Bad and oversized input is a 400 naming the field, at the HTTP edge.

Lone UTF-16 surrogates and integers beyond int64 used to pass validation and
fail later (tokenizer, msgpack, UTF-8 output) as 500s or engine crashes; a
schema nested a few hundred levels killed the engine with a RecursionError.
"""
from __future__ import annotations

import json

import pytest

MODEL = "tiny"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
S = "\ud800"  # a lone surrogate: valid JSON ("\ud800"), not valid Unicode
BIG = 2**64
HI = [{"role": "user", "content": "hi"}]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **kw}


def _cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


# (path, body, param, words the message must contain)
BAD = [
    # Lone surrogates, wherever a string can be.
    (CMPL, _cmpl(prompt=S), "prompt", ["surrogate"]),
    (CMPL, _cmpl(prompt=["ok", "a" + S]), "prompt", ["prompt.1"]),
    (CMPL, _cmpl(stop=S), "stop", []),
    (CMPL, _cmpl(stop=["ok", S]), "stop", []),
    (CMPL, _cmpl(bad_words=[S]), "bad_words", []),
    (CMPL, _cmpl(logit_bias={S: 1}), "logit_bias", []),
    (CMPL, _cmpl(user=S), "user", []),
    (CMPL, _cmpl(model=S), "model", []),
    (CMPL, _cmpl(structured_outputs={"regex": S}), "structured_outputs", ["structured_outputs.regex"]),
    (CHAT, _chat(messages=[{"role": "user", "content": S}]), "messages", ["messages.0.content"]),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": S}]}]), "messages", []),
    (CHAT, _chat(messages=[{"role": S, "content": "x"}]), "messages", []),
    (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {S: 1}}}),
     "response_format", []),
    ("/tokenize", {"prompt": S}, "prompt", []),
    ("/tokenize", {"messages": [{"role": "user", "content": S}]}, "messages", []),
    # Integers beyond int64: msgpack and torch cannot carry them.
    (CMPL, _cmpl(priority=BIG), "priority", ["64-bit"]),
    (CMPL, _cmpl(priority=-BIG), "priority", ["64-bit"]),
    (CMPL, _cmpl(truncate_prompt_tokens=BIG), "truncate_prompt_tokens", []),
    (CMPL, _cmpl(seed=BIG), "seed", []),
    (CMPL, _cmpl(stop_token_ids=[BIG]), "stop_token_ids", []),
    (CMPL, _cmpl(allowed_token_ids=[1, BIG]), "allowed_token_ids", []),
    (CMPL, _cmpl(max_tokens=BIG), "max_tokens", []),
    (CMPL, _cmpl(min_tokens=BIG), "min_tokens", []),
    (CMPL, _cmpl(top_k=BIG), "top_k", []),
    (CMPL, _cmpl(n=BIG), "n", []),
    (CMPL, _cmpl(best_of=BIG), "best_of", []),
    (CMPL, _cmpl(logprobs=BIG), "logprobs", []),
    (CMPL, _cmpl(prompt_logprobs=BIG), "prompt_logprobs", []),
    (CMPL, _cmpl(prompt=[1, BIG]), "prompt", []),
    (CHAT, _chat(logprobs=True, top_logprobs=BIG), "top_logprobs", []),
    ("/detokenize", {"tokens": [BIG]}, "tokens", []),
    # In int64 but out of the field's range.
    (CMPL, _cmpl(logit_bias={str(BIG): 1}), "logit_bias", ["vocabulary"]),
    (CMPL, _cmpl(logit_bias={"-3": 1}), "logit_bias", []),
    (CMPL, _cmpl(truncate_prompt_tokens=-1), "truncate_prompt_tokens", []),
    (CMPL, _cmpl(prompt_logprobs=2**40), "prompt_logprobs", ["20"]),
    ("/detokenize", {"tokens": [-1]}, "tokens", []),
    # Size limits (the shared server runs with the defaults).
    (CMPL, _cmpl(n=1000), "n", ["128"]),
    (CMPL, _cmpl(n=1, best_of=129, temperature=1.0), "best_of", ["128"]),
    (CMPL, _cmpl(prompt=["a"] * 257), "prompt", ["257", "256"]),
    (CMPL, _cmpl(stop=[f"s{i}" for i in range(17)]), "stop", ["17", "16"]),
    (CMPL, _cmpl(stop=["x" * 257]), "stop", ["257", "256"]),
    (CMPL, _cmpl(bad_words=[f"w{i}" for i in range(129)]), "bad_words", ["128"]),
    (CMPL, _cmpl(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias", ["1024"]),
    (CMPL, _cmpl(stop_token_ids=[1] * 4097), "stop_token_ids", ["4096"]),
    (CMPL, _cmpl(allowed_token_ids=[1] * 4097), "allowed_token_ids", ["4096"]),
    (CMPL, _cmpl(structured_outputs={"choice": [f"c{i}" for i in range(257)]}), "structured_outputs", ["256"]),
    (CMPL, _cmpl(structured_outputs={"regex": "a" * 4097}), "structured_outputs", ["4096"]),
    (CHAT, _chat(messages=HI * 1025), "messages", ["1025", "1024"]),
    ("/tokenize", {"messages": HI * 1025}, "messages", ["1024"]),
    (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(65)}}),
     "response_format", ["65", "64"]),
    # The engine killer: a schema a few hundred levels deep, as an object and as JSON text.
    (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(400)}}),
     "response_format", ["64"]),
    (CMPL, _cmpl(structured_outputs={"json": json.dumps(_nested(300))}), "structured_outputs", ["64"]),
    (CMPL, _cmpl(structured_outputs={"json": "[" * 3000 + "]" * 3000}), "structured_outputs", ["64"]),
]


def _post(http, path: str, body: dict):
    # json.dumps escapes lone surrogates as \ud800, as a JSON client may send them
    # (httpx's own encoder refuses them).
    return http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


@pytest.mark.parametrize("path,body,param,words", BAD, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(http, path, body, param, words):
    r = _post(http, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    for word in words:
        assert word in err["message"], err


def test_none_of_it_reached_the_engine_and_it_still_serves(http, server):
    before = server.wait_idle()
    for path, body, _, _ in BAD:
        assert _post(http, path, body).status_code == 400
    after = server.wait_idle()
    assert after["octavo:prompt_tokens_total"] == before["octavo:prompt_tokens_total"]
    assert _post(http, CMPL, _cmpl()).status_code == 200


def test_large_values_inside_the_ranges_are_served(http):
    body = _cmpl(priority=2**63 - 1, top_k=2**62, seed=-(2**63), truncate_prompt_tokens=2**62, n=2, best_of=128,
                 temperature=1.0, stop=["x" * 256], logit_bias={"5": 1.0}, structured_outputs=None)
    r = _post(http, CMPL, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    r = _post(http, CHAT, _chat(response_format={"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": _nested(8)}}))
    assert r.status_code == 200, r.text


def test_limits_come_from_the_command_line(tuned_server):
    with tuned_server.http() as http:
        err = _post(http, CMPL, _cmpl(n=5)).json()["error"]
        assert err["param"] == "n" and "4" in err["message"]
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
        err = _post(http, CHAT, _chat(response_format={"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": schema}})).json()["error"]
        assert err["param"] == "response_format" and "2000" in err["message"], err
        assert _post(http, CMPL, _cmpl(n=4)).status_code == 200


def test_models_root_is_the_served_name_not_a_path(http, model_path):
    r = http.get("/v1/models")
    card = r.json()["data"][0]
    assert card["root"] == card["id"] == MODEL
    assert str(model_path) not in r.text and model_path.name not in r.text


def test_a_bad_key_is_named_escaped_and_a_deep_body_is_refused(http):
    err = _post(http, CMPL, _cmpl(logit_bias={"1": 1, "a" + S: 2})).json()["error"]
    assert err["param"] == "logit_bias" and "logit_bias.a\\ud800" in err["message"], err
    err = _post(http, CMPL, {**_cmpl(), S: 1}).json()["error"]
    assert err["param"] == "\\ud800", err
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(900)}}
    err = _post(http, CHAT, _chat(response_format=schema)).json()["error"]
    assert err["param"] == "response_format" and "900" in err["message"], err
    # Deeper than json.loads recurses: the body cannot be parsed, still a 400.
    r = http.post(CMPL, content=b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
