"""Request fields: unknown ones are ignored and named (a 400 with --strict-request-fields),
fields of OpenAI's API that Octavo lacks are 400s naming them."""
from __future__ import annotations

import openai
import pytest

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
IGNORED = "x-octavo-ignored-fields"


def _error(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_unknown_fields_are_ignored_and_named(server):
    """Vendor fields of other servers' clients: the request runs as without
    them, the response header names them, the log has a warning line."""
    with server.http() as http:
        plain = {"prompt": "a", "max_tokens": 4, "temperature": 0}
        r = http.post("/v1/completions", json={**plain, "temprature": 0.5, "zeta": 1})
        assert r.status_code == 200 and r.headers[IGNORED] == "temprature, zeta"
        assert r.json()["choices"][0]["text"] == http.post("/v1/completions", json=plain).json()["choices"][0]["text"]
        assert IGNORED not in http.post("/v1/completions", json=plain).headers
        # Nested objects, streams, the Responses API and /tokenize too.
        body = {"messages": [{"role": "user", "content": "hi", "nme": "x"}], "max_tokens": 1, "stream": True,
                "stream_options": {"include_usage": True, "x": 1}}
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200 and stream.headers[IGNORED] == "nme, x"
            assert list(stream.iter_lines())[-2] == "data: [DONE]"
        r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, "colour": "red"})
        assert r.status_code == 200 and r.headers[IGNORED] == "colour"
        r = http.post("/tokenize", json={"prompt": "hi", "extra_body": {}})
        assert r.status_code == 200 and r.headers[IGNORED] == "extra_body"
        # A name with a line break cannot split the header: it is escaped.
        r = http.post("/v1/completions", json={**plain, "a\r\nSet-Cookie: x": 1})
        assert r.headers[IGNORED] == "a\\r\\nSet-Cookie: x" and "set-cookie" not in r.headers
    assert "ignored unknown fields: temprature, zeta" in server.log()


def test_strict_request_fields_refuses_them_naming_all(tuned_server):
    with tuned_server.http() as http:
        err = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "temprature": 0.5, "zeta": 1}))
        assert err["param"] == "temprature" and err["message"] == "unknown fields: temprature, zeta"
        err = _error(http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "top_n": 2}))
        assert err["param"] == "top_n" and "unknown field: top_n" in err["message"]
        # Nested objects too: the message says where.
        body = {"messages": [{"role": "user", "content": "hi", "nme": "x"}], "max_tokens": 1}
        err = _error(http.post("/v1/chat/completions", json=body))
        assert err["param"] == "messages" and err["message"] == "messages.0: unknown field: nme"
        body = {"prompt": "a", "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True, "x": 1}}
        assert _error(http.post("/v1/completions", json=body))["message"] == "stream_options: unknown field: x"
        err = _error(http.post("/v1/responses", json={"input": "x", "colour": "red"}))
        assert err["param"] == "colour" and "unknown field" in err["message"]


def test_openai_fields_octavo_lacks_are_unsupported_not_dropped(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, store=True)
    assert exc.value.body["param"] == "store" and exc.value.body["message"] == "not supported by this server: store"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, modalities=["audio"],
                                       reasoning_effort="low")
    assert exc.value.body["message"] == "not supported by this server: modalities, reasoning_effort"
    # A null asks for nothing: clients that send every key with nulls still work.
    with server.http() as http:
        body = {"messages": [{"role": "user", "content": "hi", "refusal": None}], "max_tokens": 1, "store": None}
        assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_stream_options_without_stream(server):
    client = server.openai()
    for create, kw in ((client.completions.create, {"prompt": "a"}), (client.chat.completions.create, {"messages": HI})):
        with pytest.raises(openai.BadRequestError) as exc:
            create(model=MODEL, max_tokens=1, stream_options={"include_usage": True}, **kw)
        assert exc.value.body["param"] == "stream_options"
        assert "only allowed when stream is true" in exc.value.body["message"]


def test_vllm_sampling_extensions_are_declared(server):
    """Every vLLM field Octavo implements is accepted on both endpoints."""
    extras = {
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2, "priority": 1,
        "skip_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": [3],
        "truncate_prompt_tokens": 3, "allowed_token_ids": [5, 6, 7], "bad_words": ["zz"], "prompt_logprobs": 1,
        "structured_outputs": None, "seed": 3,
    }
    with server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "add_special_tokens": False, **extras})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "add_special_tokens": False, **extras})
        assert r.status_code == 200, r.text
