"""Every bad request gets the right status and OpenAI's error shape, and never reaches the engine."""
from __future__ import annotations

import pytest

MODEL = "tiny"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]

# (endpoint, body, status, param)
CASES = [
    (CMPL, {"model": MODEL}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [[]]}, 400, "prompt"),
    (CMPL, {"prompt": [1, 2, 99999]}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    (CMPL, {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    (CMPL, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 5, "min_tokens": 9}, 400, "min_tokens"),
    (CMPL, {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (CMPL, {"prompt": "hi", "suffix": "tail"}, 400, "suffix"),
    (CMPL, {"prompt": "hi", "max_tokens": 100000}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user"}], "max_tokens": 100000}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages"),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": HI, "max_completion_tokens": -2}, 400, "max_completion_tokens"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (CHAT, {"messages": HI, "response_format": {"type": "yaml"}}, 400, "response_format"),
    (CHAT, {"messages": HI, "model": "nope"}, 404, "model"),
]


def _check_shape(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{c[0][4:]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_request(http, path, body, status, param):
    body = {"model": MODEL, **body} if "model" not in body and path == CHAT else body
    err = _check_shape(http.post(path, json=body), status, param)
    if status == 404:
        assert err["code"] == "model_not_found"


def test_context_length_message(http, server):
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    r = http.post(CMPL, json={"prompt": [7] * max_len, "max_tokens": 1})
    err = _check_shape(r, 400, "prompt")
    assert f"maximum context length is {max_len} tokens" in err["message"]
    assert f"you requested {max_len + 1} tokens" in err["message"]


def test_malformed_json_and_methods(http):
    r = http.post(CMPL, content=b'{"prompt": "hi",', headers={"Content-Type": "application/json"})
    assert "JSON" in _check_shape(r, 400)["message"]
    _check_shape(http.get(CMPL), 405)
    _check_shape(http.get("/v1/nothing-here"), 404)


def test_oversized_body(http):
    big = {"prompt": "x" * (70 * 1024)}  # the server's limit is 64 KiB
    _check_shape(http.post(CMPL, json=big), 413)

    def chunks():  # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}'

    _check_shape(http.post(CMPL, content=chunks(), headers={"Content-Type": "application/json"}), 413)


def test_bad_requests_never_reach_the_engine(http, server):
    before = server.wait_idle()
    for path, body, status, _ in CASES:
        body = {"model": MODEL, **body} if "model" not in body and path == CHAT else body
        assert http.post(path, json=body).status_code == status
    after = server.wait_idle()
    for name in ("octavo:prompt_tokens_total", "octavo:generation_tokens_total", "octavo:prefix_cache_queries_total"):
        assert after[name] == before[name], name
    # ...and the server still serves.
    r = http.post(CMPL, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_grammars_the_engine_refuses_are_400(http):
    """Schemas and regexes are compiled next to the vocabulary, in the engine
    process: a refusal there must still be a 400, streaming or not, before any
    200 header is sent."""
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    for stream in (False, True):
        r = http.post(CHAT, json={"model": MODEL, "messages": HI, "response_format": bad_schema, "stream": stream})
        _check_shape(r, 400, "response_format")
        r = http.post(CMPL, json={"prompt": "hi", "stream": stream, "structured_outputs": {"regex": "(unclosed"}})
        assert "regex" in _check_shape(r, 400, "structured_outputs")["message"]
    assert http.post(CMPL, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
