"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import json
import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status, headers=err.headers)


def sse_error(err: APIError) -> str:
    """The error event a stream ends with when it fails after it started."""
    return f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients expect 400 naming the field.
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(bad_request(f"malformed JSON body: {first.get('msg', '')}"))
        # The top-level field is the param; the message keeps the full path.
        param = loc[0] if loc else None
        where = ".".join(loc)
        message = f"{where}: {first.get('msg', 'invalid value')}" if where else first.get("msg", "invalid body")
        return error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
