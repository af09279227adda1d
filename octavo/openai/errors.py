"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

A 500 never shows the client what failed (exception classes and messages can
carry paths, prompts of other requests or internals worth probing): the body
says "internal error" with the request id, and the log has the detail and the
traceback under the same id.
"""
from __future__ import annotations

import contextvars
import json
import logging
from typing import Optional, Sequence

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
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    503: "service_unavailable_error",
}

# Set per request by the server's RequestIdMiddleware; read where errors are logged and answered.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("octavo_request_id", default="-")


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


class FieldError(ValueError):
    """A request validator's error that knows the path of the bad value
    (pydantic would otherwise place errors of a whole-body check at the body)."""

    def __init__(self, path: Sequence[str | int], message: str, named: bool = False) -> None:
        super().__init__(message)
        self.path = [str(p) for p in path]
        self.message = message
        # The message names the bad key itself: the path before it is enough context.
        self.named = named


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


class InternalError(APIError):
    """A 500 whose detail is in the log only."""


def internal_error(detail: str, code: Optional[str] = None, exc_info: bool = False) -> InternalError:
    """Log ``detail`` under the request id; the client sees only the id and
    the ``code`` (a category such as "engine_dead", not a detail)."""
    request_id = REQUEST_ID.get()
    logger.error("internal error [request %s]: %s", request_id, detail, exc_info=exc_info)
    return InternalError(500, f"internal error (request id {request_id})", code=code or "internal_error")


def _public(err: APIError) -> APIError:
    if err.status == 500 and not isinstance(err, InternalError):
        return internal_error(err.message, err.code)
    return err


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
    err = _public(err)
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status, headers=err.headers)


def sse_error(err: APIError) -> str:
    """The error event a stream ends with when it fails after it started."""
    err = _public(err)
    return f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"


def validation_error(errors: Sequence[dict]) -> APIError:
    """The 400 for pydantic's errors of a request body: the first one, naming
    its field (also how the gateway answers bodies it validates itself)."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('msg', '')}")
    cause = (first.get("ctx") or {}).get("error")
    msg = first.get("msg", "invalid value")
    where_loc = loc
    if isinstance(cause, FieldError):
        # The error's own path continues the location of the object that raised it.
        where_loc = loc if cause.named else loc + cause.path
        loc, msg = loc + cause.path, cause.message
    # The top-level field is the param; the message keeps the full path.
    param = loc[0] if loc else None
    where = ".".join(where_loc)
    message = f"{where}: {msg}" if where else msg
    return bad_request(message, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients expect 400 naming the field.
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))
