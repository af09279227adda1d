"""The gateway in front of three replicas: same greedy outputs as a replica,
bad input answered without a replica, the admin API, 503 when all fail."""
from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import ADMIN_KEY, GatewayProcess

PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4"]


@pytest.fixture(scope="module")
def gateway(replicas, tmp_path_factory):
    args = [a for r in replicas for a in ("--replica", r.url)]
    gw = GatewayProcess(tmp_path_factory.mktemp("gw") / "gw.log", *args, "--routing", "round-robin", "--no-cache")
    yield gw
    gw.stop()


def _requests_sent(gw: GatewayProcess) -> float:
    return sum(v for k, v in gw.metrics().items() if k.startswith("octavo_gateway:requests_total"))


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_a_replica_directly(gateway, replicas, stream):
    direct, through = replicas[0].openai(), gateway.openai()
    for prompt in PROMPTS:  # round-robin: each prompt on another replica
        kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=stream)
        if stream:
            want = "".join(c.choices[0].text for c in direct.completions.create(**kw))
            got = "".join(c.choices[0].text for c in through.completions.create(**kw))
        else:
            want = direct.completions.create(**kw).choices[0].text
            got = through.completions.create(**kw).choices[0].text
        assert got == want and want


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_a_replica_directly(gateway, replicas, stream):
    direct, through = replicas[1].openai(), gateway.openai()
    for prompt in PROMPTS:
        kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0,
                  stream=stream)
        if stream:
            want = "".join(c.choices[0].delta.content or "" for c in direct.chat.completions.create(**kw) if c.choices)
            got = "".join(c.choices[0].delta.content or "" for c in through.chat.completions.create(**kw) if c.choices)
        else:
            want = direct.chat.completions.create(**kw).choices[0].message.content
            got = through.chat.completions.create(**kw).choices[0].message.content
        assert got == want and want


def test_round_robin_spreads_over_all_replicas(gateway, replicas):
    served = set()
    for _ in range(6):
        r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        served.add(r.headers["x-octavo-replica"])
    assert served == {r.url for r in replicas}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
        ("/v1/chat/completions", {"messages": "not a list"}, "messages"),
    ],
)
def test_bad_input_is_answered_by_the_gateway_as_a_replica_would(gateway, replicas, path, body, param):
    sent = _requests_sent(gateway)
    got = httpx.post(gateway.url + path, json=body, timeout=30)
    want = httpx.post(replicas[0].url + path, json=body, timeout=30)
    assert got.status_code == want.status_code == 400
    assert got.json() == want.json() and got.json()["error"]["param"] == param
    assert _requests_sent(gateway) == sent  # no replica was asked


def test_malformed_json_is_400(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_models_pass_through(gateway):
    assert [m.id for m in gateway.openai().models.list()] == ["tiny"]


def test_admin_api_adds_and_removes_replicas(gateway, replicas):
    r = httpx.get(f"{gateway.url}/admin/replicas", timeout=10)
    assert r.status_code == 401
    r = httpx.get(f"{gateway.url}/admin/replicas", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    assert {x["url"] for x in gateway.admin("GET").json()["replicas"]} == {r.url for r in replicas}
    assert gateway.admin("DELETE", {"url": replicas[2].url}).status_code == 200
    try:
        served = {httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "a", "max_tokens": 1},
                             timeout=60).headers["x-octavo-replica"] for _ in range(4)}
        assert served == {replicas[0].url, replicas[1].url}
    finally:
        assert gateway.admin("POST", {"url": replicas[2].url}).status_code == 200
    assert len(gateway.admin("GET").json()["replicas"]) == 3
    bad = gateway.admin("POST", {"url": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    assert ADMIN_KEY not in gateway.log()


def test_every_replica_failing_is_a_clear_503(tmp_path):
    from tests.server.conftest import free_port

    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", dead[0], "--replica", dead[1])
    try:
        r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_replica_available"
        assert int(r.headers["retry-after"]) >= 1  # a breaker's cool-down and a probe away
        errors = {k: v for k, v in gw.metrics().items() if k.startswith("octavo_gateway:replica_errors_total")}
        # Each replica tried at most once (probes may have opened a breaker before the request came).
        assert len(errors) <= 2 and all(v == 1.0 for v in errors.values())
    finally:
        gw.stop()


def test_breakers_opening_are_logged_by_replica(tmp_path):
    from tests.server.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", dead)
    try:
        for _ in range(3):
            httpx.post(f"{gw.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)
        assert f"replica {dead}: breaker opened after" in gw.log()
    finally:
        gw.stop()
