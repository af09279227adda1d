"""Several API keys (flags, a key file, the environment), a separate /metrics key,
constant-time checks against every key, and no key ever in a response or the log."""
from __future__ import annotations

import asyncio
import hmac

import httpx
import pytest

from octavo.entrypoints.cli import main
from octavo.server.middleware import APIKeyMiddleware
from tests.server.conftest import ServerProcess

KEYS = ["sk-flag-one", "sk-file-two", "sk-file-three"]
METRICS_KEY = "sk-metrics-only"
WRONG = "sk-wrong-guess"


@pytest.fixture(scope="module")
def keyed(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    key_file = folder / "keys.txt"
    key_file.write_text(f"# operators' keys\n{KEYS[1]}\n\n  {KEYS[2]}  \n")
    srv = ServerProcess(
        model_path, folder / "server.log", "--num-blocks", "64", "--served-model-name", "tiny",
        "--api-key", KEYS[0], "--api-key-file", str(key_file), "--metrics-api-key", METRICS_KEY,
        "--log-level", "debug",  # the most the log can say, keys must still not be in it
        api_key=None,
    )
    yield srv
    srv.stop()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_key_opens_the_api_and_no_other(keyed):
    for key in KEYS:
        assert httpx.get(keyed.url + "/v1/models", headers=_bearer(key)).status_code == 200, key
    for key in (WRONG, METRICS_KEY, KEYS[0] + "x", KEYS[0][:-1], "-"):
        r = httpx.post(keyed.url + "/v1/completions", headers=_bearer(key), json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", key


def test_metrics_has_its_own_key_and_health_stays_public(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    assert httpx.get(keyed.url + "/metrics", headers=_bearer(KEYS[0])).status_code == 401
    r = httpx.get(keyed.url + "/metrics", headers=_bearer(METRICS_KEY))
    assert r.status_code == 200 and "octavo:kv_free_blocks" in r.text


def test_keys_never_leak_into_bodies_or_the_log(keyed):
    bodies = [
        httpx.get(keyed.url + "/v1/models", headers=_bearer(WRONG)).text,
        httpx.get(keyed.url + "/metrics", headers=_bearer(KEYS[1])).text,
        httpx.post(keyed.url + "/v1/completions", headers=_bearer(KEYS[0]), json={"prompt": "hi", "n": 0}).text,
    ]
    log = keyed.log()
    for secret in (*KEYS, METRICS_KEY, WRONG):
        assert all(secret not in body for body in bodies), secret
        assert secret not in log, secret


def test_environment_key(model_path, tmp_path):
    srv = ServerProcess(model_path, tmp_path / "env.log", "--num-blocks", "64", api_key="sk-from-env", key_from_env=True)
    try:
        assert httpx.get(srv.url + "/v1/models", headers=_bearer("sk-from-env")).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers=_bearer(WRONG)).status_code == 401
        assert httpx.get(srv.url + "/metrics").status_code == 200  # public by default
    finally:
        srv.stop()


def test_every_key_is_compared_whichever_matches(monkeypatch):
    """No early exit: the number of comparisons (and so the time) does not say which key matched."""
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = APIKeyMiddleware(ok, api_keys=("k1", "k2", "k3", "k4"), public_routes=(), route_keys={})
    for key, status in (("k1", 200), ("k4", 200), ("nope", 401)):
        calls.clear()
        sent = []

        async def send(message, sent=sent):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/v1/models",
                 "headers": [(b"authorization", f"Bearer {key}".encode())]}
        asyncio.run(app(scope, None, send))
        assert sent[0]["status"] == status and len(calls) == 4, key


def test_bad_key_files_are_refused(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    for path, words in ((tmp_path / "missing.txt", "cannot read"), (empty, "no keys")):
        with pytest.raises(SystemExit) as exc:
            main(["serve", str(tmp_path), "--api-key-file", str(path)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--api-key-file" in err and words in err
