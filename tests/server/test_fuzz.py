"""Schemathesis against the server's own /openapi.json: bodies that fit the
schema and bodies that break it, on every operation, get no 5xx, and the
server logs no unhandled traceback; afterwards every KV block is free.

The fuzzed server is this module's own: a crash found here (an engine that
dies) must not fail unrelated tests that share the session server.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Optional

import hypothesis
import pytest
import requests
import schemathesis
from schemathesis.checks import not_a_server_error

from tests.server.conftest import ServerProcess

# Per operation, for the fuzzing phase; the coverage phase adds its own
# boundary cases for every field on top. Most of the time goes to generating
# the bodies (hypothesis, in this process; profiled: about 2/3 of the test's
# time), not to the server answering them, so this count sets the time.
MAX_EXAMPLES = 100
REQUEST_TIMEOUT_S = 30
# Lines the server writes only when something escaped a handler.
TRACEBACK_MARKERS = ("Traceback", "Exception in ASGI application", "unhandled error")
# Values drawn for some fields (BINDINGS: 70% of the time): a random string is
# most often an empty prompt or an unknown model, a 400 before any engine code
# runs. With these, bodies get past those first checks and the fuzzing of the
# other fields reaches tokenization, scheduling, sampling and detokenizing.
# (Lone UTF-16 surrogates cannot come from here: schemathesis never generates
# them and its validator refuses them in dictionaries. They need explicit
# cases in the bad-input table.)
DICTIONARIES = {
    "models": {"values": ["tiny"]},
    "prompts": {"values": ["hi", "Once upon a time", "x" * 300, "\u00e9\u4e2d\U0001f600", "<|eot|>"]},
    "roles": {"values": ["user", "assistant", "system", "tool"]},
    "token_ids": {"values": [0, 1, 5, 100, 511]},
    "max_tokens": {"values": [1, 4, 16]},
    # Past what crosses the engine boundary as a C integer or a double.
    "int_edges": {"values": [2**63, -(2**63) - 1, 2**64, 10**30]},
    "float_edges": {"values": [1e308, -1e308, 5e-324]},
}
# The integer and float fields the engine receives. (A type-wide binding would
# be shorter, but schemathesis does not apply it to FastAPI's `anyOf [x, null]`.)
INT_FIELDS = ("n", "best_of", "seed", "priority", "top_k", "min_tokens", "logprobs", "top_logprobs",
              "prompt_logprobs", "truncate_prompt_tokens", "stop_token_ids[*]", "allowed_token_ids[*]")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
BINDINGS = {
    "model": "models",
    "prompt": "prompts",
    "messages[*].role": "roles",
    "messages[*].content": "prompts",
    "tokens[*]": "token_ids",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
}


class FuzzWatch:
    """What the fuzzing saw: statuses per operation, the server log read from
    where the previous case stopped (so a traceback is pinned on the request
    that caused it), and whether the server is still usable at all."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.offset = 0
        self.statuses: Counter[tuple[str, int]] = Counter()
        # Set once the server stops answering or its engine died: every later
        # case then fails at once instead of waiting out its timeout.
        self.broken: Optional[str] = None
        # A traceback can reach the log just after its response (a stream that
        # fails once its 200 header is out), so a hit names the case before too.
        self.previous = "(none)"

    def new_lines(self) -> str:
        with open(self.srv.log_path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        return chunk.decode(errors="replace")

    def require_usable(self) -> None:
        if self.broken is not None:
            pytest.fail(f"the server broke earlier: {self.broken}")

    def probe(self, what: str) -> None:
        """After a 5xx: is it this request only, or is the engine gone?"""
        health = requests.get(f"{self.srv.url}/health", timeout=REQUEST_TIMEOUT_S)
        if health.status_code != 200:
            self.broken = f"/health {health.status_code} {health.text[:300]} after {what}"

    def assert_clean(self, what: str, text: str) -> None:
        previous, self.previous = self.previous, what
        hits = [m for m in TRACEBACK_MARKERS if m in text]
        assert not hits, f"server logged {hits} after\n  {what}\nor the case before it:\n  {previous}\nlog:\n{text[-4000:]}"


@pytest.fixture(scope="module")
def fuzz_server(model_path, tmp_path_factory):
    # A body without max_tokens generates max_new_tokens, not the rest of the
    # context: the endpoints, not long generations, are what is fuzzed (with
    # the context as the default, half the run went to chat and responses
    # bodies generating hundreds of tokens each).
    defaults = tmp_path_factory.mktemp("fuzz-defaults")
    (defaults / "generation_config.json").write_text('{"max_new_tokens": 16}')
    srv = ServerProcess(
        model_path,
        tmp_path_factory.mktemp("fuzz") / "server.log",
        "--generation-config", str(defaults),
        "--num-blocks", "512",
        "--max-num-seqs", "32",
        "--max-body-size", "64KiB",
        "--served-model-name", "tiny",
        # A body that makes the engine allocate without bound (n=10**7 once did)
        # fails there instead of taking the machine's memory.
        memory_limit=6 * 2**30,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def watch(fuzz_server) -> FuzzWatch:
    return FuzzWatch(fuzz_server)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    config = schemathesis.Config.from_dict({
        # The key on every generated request, so the fuzzing reaches the handlers.
        "headers": fuzz_server.headers,
        "request-timeout": REQUEST_TIMEOUT_S,
        # Whole reproducing commands: by default fields named like *token* are
        # "[Filtered]" (max_tokens, stop_token_ids...) and long bodies cut.
        "output": {
            "sanitization": {"keys-to-sanitize": ["authorization"], "sensitive-markers": ["authorization"]},
            "truncation": {"enabled": False},
        },
        "dictionaries": DICTIONARIES,
        "parameters": {
            **{f"body.{field}": {"dictionary": "int_edges", "probability": 0.25} for field in INT_FIELDS},
            **{f"body.{field}": {"dictionary": "float_edges", "probability": 0.25} for field in FLOAT_FIELDS},
            **{f"body.{field}": {"dictionary": name, "probability": 0.7} for field, name in BINDINGS.items()},
        },
        "generation": {
            "mode": "all",  # positive (schema-valid) and negative (schema-breaking) bodies
            "max-examples": MAX_EXAMPLES,
            # No shrinking: the server has state (a request can kill the engine and
            # every later one then fails), so the first failing input is the culprit.
            "no-shrink": True,
            "database": "none",  # nothing written under .hypothesis/
        },
    })
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", config=config, headers=fuzz_server.headers)


def _fill_empty_input(body):
    """The coverage phase varies one field at a time around a body whose
    prompt is "" (and hypothesis likes the empty prompt too): most bodies
    stopped at "prompt must not be empty", which test_errors.py covers. Given
    some input, the rest of the body is what gets tested. Done on the case, not
    in a schemathesis hook: the coverage phase does not run body hooks."""
    if isinstance(body, dict):
        if body.get("prompt") in ("", []):
            body = {**body, "prompt": "Once upon a time"}
        if body.get("messages") == []:
            body = {**body, "messages": [{"role": "user", "content": "hi"}]}
    return body


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@hypothesis.settings(deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
def test_fuzz_no_server_error(case, watch):
    watch.require_usable()
    case.body = _fill_empty_input(case.body)
    what = case.as_curl_command()[:3000]
    try:
        response = case.call()
    except requests.RequestException:
        watch.broken = f"no answer within {REQUEST_TIMEOUT_S} s to {what}"
        raise
    watch.statuses[(case.operation.label, response.status_code)] += 1
    # Read before the status check can fail, so a traceback stays pinned on this case.
    logged = watch.new_lines()
    if response.status_code >= 500:
        watch.probe(what)
        time.sleep(0.5)  # uvicorn's own traceback may follow the response
        logged += watch.new_lines()
    case.validate_response(response, checks=[not_a_server_error])
    watch.assert_clean(what, logged)


def test_fuzzed_server_is_idle_and_serves(fuzz_server, watch):
    """After the fuzzing: it reached the engine, no KV block is held by a
    request that failed, and the engine still answers."""
    print("\nfuzzing statuses:", dict(sorted(watch.statuses.items())))
    for op in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"):
        assert watch.statuses[(op, 200)] > 0, f"no fuzzed {op} got past validation: {watch.statuses}"
    fuzz_server.wait_idle(timeout_s=60)
    with fuzz_server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    watch.assert_clean("the fuzzing", watch.new_lines())
