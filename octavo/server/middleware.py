"""ASGI middlewares: API-key check and request body size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses
and the handlers' disconnect detection see the untouched ``receive``.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException

from octavo.server.errors import error_body

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


class APIKeyMiddleware:
    """Every HTTP route except ``public_routes`` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str, public_routes: tuple[str, ...]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._public = set(public_routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        # compare_digest: the time taken must not reveal how much of the key matched.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            await _send_error(
                send, 401, "Incorrect API key provided.", "invalid_api_key", {"WWW-Authenticate": "Bearer"}
            )
            return
        await self.app(scope, receive, send)


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
