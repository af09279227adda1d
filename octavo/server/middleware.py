"""ASGI middlewares: request ids, API-key check and request body size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses
and the handlers' disconnect detection see the untouched ``receive``.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import uuid
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException

from octavo.openai.errors import REQUEST_ID, error_body, internal_error

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _send_error(send: Send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Every response carries ``X-Request-Id``: the client's own when it sent
    a sane one (so its logs and ours join), else a fresh one. Outermost, so
    that 401s and 413s carry it too; an exception no handler took becomes the
    generic 500 here, where the id is known and the header can still be set."""

    _SANE = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"x-request-id", b"")
        request_id = sent.decode() if self._SANE.match(sent) else uuid.uuid4().hex
        REQUEST_ID.set(request_id)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise  # too late for a status: the server closes the connection
            err = internal_error(f"{type(exc).__name__}: {exc}", exc_info=True)
            await _send_error(send_with_id, 500, err.message, "internal_error")


class APIKeyMiddleware:
    """Routes need ``Authorization: Bearer <key>`` with one of ``api_keys``,
    except ``public_routes``; ``route_keys`` gives some routes their own keys
    instead (e.g. /metrics for the scraper only).

    The token is hashed and compared with every key's hash, with no early
    exit: neither the time taken nor which comparison ran reveals how much of
    a key, or which key, matched. Keys never appear in an error or the log."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: tuple[str, ...],
        public_routes: tuple[str, ...],
        route_keys: dict[str, tuple[str, ...]],
    ) -> None:
        self.app = app
        self._keys = [_digest(k.encode()) for k in api_keys]
        self._public = set(public_routes)
        self._route_keys = {route: [_digest(k.encode()) for k in keys] for route, keys in route_keys.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope)
        keys = self._route_keys.get(path)
        if keys is None:
            keys = [] if path in self._public else self._keys
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not keys:
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        given = _digest(token.strip())
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(given, key)
        if scheme.lower() != b"bearer" or not matched:
            await _send_error(
                send, 401, "Incorrect API key provided.", "invalid_api_key", {"WWW-Authenticate": "Bearer"}
            )
            return
        await self.app(scope, receive, send)


def _digest(key: bytes) -> bytes:
    # Equal-length digests: compare_digest then takes the same time whatever the key lengths.
    return hashlib.sha256(key).digest()


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: by Content-Length up front, else
    (chunked uploads) while the handler reads the body. The latter raises an
    HTTPException because FastAPI turns any other error while reading the
    body into a generic 400."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self._max = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._max:
            await _send_error(send, 413, self._message, "body_too_large")
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._max:
                    raise HTTPException(413, self._message)
            return message

        await self.app(scope, counting_receive, send)

    @property
    def _message(self) -> str:
        return f"request body larger than {self._max} bytes"


def route_path(scope: Scope) -> str:
    """The path as the routes name it: behind a proxy that keeps the
    --root-path prefix ("/api/v1/models"), without it ("/v1/models")."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root):]
    return path
