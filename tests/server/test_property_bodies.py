"""Property: every request body is answered 200 or 4xx in OpenAI's error shape, never 5xx.

Bodies mix plausible values with arbitrary JSON (huge integers, NaN, lone
surrogates, wrong types, nesting) per field, against the real server.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_garbage = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-2, 300),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10),
        st.sampled_from(["\ud800", "x\udfff", "tiny", "text", "json_object"]),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)
_words = st.text(min_size=1, max_size=6)
_ids = st.lists(st.integers(0, 60), min_size=1, max_size=4)
_COMMON = {
    "model": st.just("tiny"), "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 100), "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(_words, st.lists(_words, max_size=3)), "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 60).map(str), st.floats(-100, 100), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(), "priority": st.integers(-(2**63), 2**63 - 1), "min_tokens": st.integers(0, 2),
    "stop_token_ids": _ids, "allowed_token_ids": _ids, "bad_words": st.lists(st.text("ab ", min_size=1), max_size=2),
    "truncate_prompt_tokens": st.integers(1, 50), "prompt_logprobs": st.integers(0, 5),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}]),
    "structured_outputs": st.sampled_from([{"regex": "[ab]+"}, {"choice": ["yes", "no"]}, {"json": {"type": "boolean"}}]),
}
_CMPL = {**_COMMON, "prompt": st.one_of(st.text(min_size=1, max_size=30), _ids, st.lists(_words, min_size=1, max_size=3)),
         "echo": st.booleans(), "logprobs": st.integers(0, 5), "best_of": st.integers(1, 4)}
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                  "content": st.one_of(st.text(max_size=20), st.just([{"type": "text", "text": "hi"}]))})
_CHAT = {**_COMMON, "messages": st.lists(_message, min_size=1, max_size=3), "logprobs": st.booleans(),
         "top_logprobs": st.integers(0, 5), "max_completion_tokens": st.integers(0, 3)}


def _body(fields: dict, required: str) -> st.SearchStrategy[dict]:
    """Each field plausible most of the time, arbitrary JSON otherwise; max_tokens
    always small so that accepted requests finish fast."""
    optional = {name: st.one_of(*[s] * 6, _garbage) for name, s in fields.items() if name != required}
    fixed = {required: st.one_of(*[fields[required]] * 6, _garbage), "max_tokens": st.integers(0, 3)}
    return st.fixed_dictionaries(fixed, optional=optional)


_TOKENIZE = {"prompt": st.text(min_size=1, max_size=30), "messages": st.lists(_message, min_size=1, max_size=2),
             "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans()}
_DETOKENIZE = {"tokens": _ids}


@pytest.fixture(scope="module")
def log_start(server) -> int:
    """Where this module's part of the shared server's log begins."""
    server._log.flush()
    return server.log_path.stat().st_size


@pytest.fixture(scope="module")
def http(server, log_start):
    with server.http() as client:
        yield client


def _check(http, path: str, body: dict) -> None:
    r = http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["param"] is None or err["param"] in body or err["param"] in ("prompt", "messages"), (err, body)
    elif body.get("stream") is True:
        assert '"server_error"' not in r.text and r.text.rstrip().endswith("data: [DONE]"), r.text


_SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(body=_body(_CMPL, "prompt"))
def test_completion_bodies(http, body):
    _check(http, "/v1/completions", body)


@_SETTINGS
@given(body=_body(_CHAT, "messages"))
def test_chat_bodies(http, body):
    _check(http, "/v1/chat/completions", body)


@_SETTINGS
@given(body=_body(_TOKENIZE, "prompt"))
def test_tokenize_bodies(http, body):
    _check(http, "/tokenize", body)


@_SETTINGS
@given(body=_body(_DETOKENIZE, "tokens"))
def test_detokenize_bodies(http, body):
    _check(http, "/detokenize", body)


def test_engine_idle_serving_and_no_traceback_after_the_fuzzing(server, http, log_start):
    server.wait_idle()
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    server._log.flush()
    with open(server.log_path, "rb") as f:
        f.seek(log_start)
        log = f.read().decode(errors="replace")
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
