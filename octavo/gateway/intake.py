"""Reading what a client sends, within bounds: the body (413 past
``max_body_bytes``, 408 when it does not arrive within ``body_timeout_s``),
its JSON (400 for a body nested deeper than the parser recurses) and the
headers the gateway passes on (400 unless printable ASCII).

The body is counted while it arrives and refused as soon as it is too large,
so a huge upload costs the gateway at most ``max_body_bytes``; a declared
Content-Length over the limit is refused before a byte of the body is read.
Refusals close the connection: the rest of the upload is never read.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from octavo.openai.errors import APIError, bad_request

# The gateway refuses more than this client can send; keep-alive would have it read the rest first.
_CLOSE = {"Connection": "close"}


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
                       headers=_CLOSE) from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body larger than {max_bytes} bytes", code="body_too_large", headers=_CLOSE)


def parse_json(raw: bytes) -> Any:
    """The body's JSON value; a 400 for malformed or too deeply nested JSON."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None


def header_value(request: Request, name: str) -> str | None:
    """A header the gateway passes on or reads, or None; a 400 naming it when
    it is not printable ASCII (it could not be sent on, nor logged as sent)."""
    value = request.headers.get(name)
    if value is not None and not (value.isascii() and value.isprintable()):
        raise bad_request(f"header {name}: only printable ASCII characters are allowed", name)
    return value
