"""500s tell the client a request id, never what failed; the log has the detail under that id."""
from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from octavo.config import EngineConfig, ModelConfig
from octavo.openai.errors import REQUEST_ID, APIError, error_response
from octavo.server.app import build_app
from octavo.server.config import ServerConfig


class _BrokenState:
    """Stands in for ServerState (the lifespan does not run under ASGITransport):
    every route that reads the model name fails with an internal error."""

    @property
    def model_name(self) -> str:
        raise OverflowError("secret detail /srv/models/private")

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name,)


def _get(app, path: str, headers: dict | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get(path, headers=headers or {})

    return asyncio.run(go())


@pytest.fixture()
def broken_app(model_path):
    app = build_app(EngineConfig(model=ModelConfig(model=str(model_path))), ServerConfig())
    app.state.server = _BrokenState()
    return app


def test_internal_error_hides_the_detail_and_logs_it_under_the_id(broken_app, caplog):
    with caplog.at_level(logging.ERROR):
        r = _get(broken_app, "/v1/models")
    assert r.status_code == 500
    request_id = r.headers["x-request-id"]
    err = r.json()["error"]
    assert err["message"] == f"internal error (request id {request_id})"
    assert err["code"] == "internal_error" and err["type"] == "server_error"
    assert "secret" not in r.text and "OverflowError" not in r.text
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and "secret detail" in logged[0].getMessage()
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is OverflowError  # the traceback


def test_client_request_id_is_kept_when_sane(broken_app):
    r = _get(broken_app, "/version", {"X-Request-Id": "trace-42.a:b"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a:b"
    r = _get(broken_app, "/v1/models", {"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and "abc-123" in r.json()["error"]["message"]
    for insane in ("x" * 200, "a b", "<script>"):
        r = _get(broken_app, "/version", {"X-Request-Id": insane})
        assert r.headers["x-request-id"] != insane and len(r.headers["x-request-id"]) == 32


def test_engine_500_messages_are_hidden_too(caplog):
    token = REQUEST_ID.set("rid-1")
    try:
        with caplog.at_level(logging.ERROR):
            r = error_response(APIError(500, "the engine failed this request: KeyError 'x'", code="engine_error"))
    finally:
        REQUEST_ID.reset(token)
    body = r.body.decode()
    assert "KeyError" not in body and "internal error (request id rid-1)" in body and "engine_error" in body
    assert any("rid-1" in rec.getMessage() and "KeyError" in rec.getMessage() for rec in caplog.records)


def test_every_response_of_the_real_server_has_a_request_id(server):
    responses = [
        httpx.get(server.url + "/health"),
        httpx.get(server.url + "/v1/models"),  # 401: no key
        httpx.post(server.url + "/v1/completions", content=b"x" * 70_000),  # 413
        httpx.get(server.url + "/v1/models", headers=server.headers),
        httpx.get(server.url + "/nowhere", headers=server.headers),  # 404
    ]
    ids = [r.headers.get("x-request-id") for r in responses]
    assert [r.status_code for r in responses] == [200, 401, 413, 200, 404]
    assert all(ids) and len(set(ids)) == len(ids)
