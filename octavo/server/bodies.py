"""Request bodies, parsed and validated off the event loop.

Parsing a body of a few megabytes is work in proportion to its size: JSON
decoding, the raw-value walk, pydantic's validation and, for a bad value in
a long array, an error that pydantic builds around the whole array. On the
event loop that stalled every other client (a 10 MB prompt of token ids
whose last item was a string froze /health for over 5 s); in a thread the
loop keeps serving. Pydantic holds the GIL while it validates, so what it
is given is bounded first: an array or object longer than any field may
hold (the context length, or the largest per-field limit) is a 400 before
validation starts.

Unknown fields are dropped, logged and named in the response header
``x-octavo-ignored-fields`` (clients written for other OpenAI-compatible
servers send their vendor fields); ``--strict-request-fields`` makes them a
400 naming them instead.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.responses import Response

from octavo.openai.errors import REQUEST_ID, bad_request, validation_error
from octavo.openai.protocol import IGNORED_FIELDS, STRICT_FIELDS

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-octavo-ignored-fields"
_MAX_LISTED = 32

T = TypeVar("T", bound=pydantic.BaseModel)


async def read_body(request: Request, model: type[T], max_items: int, strict_fields: bool) -> tuple[T, list[str]]:
    """The validated body and the unknown field names it dropped (a 400 for
    a bad body, a 413 from the body-size limit while it is read)."""
    raw = await request.body()
    return await asyncio.to_thread(parse_body, raw, model, max_items, strict_fields)


def parse_body(raw: bytes, model: type[T], max_items: int, strict_fields: bool) -> tuple[T, list[str]]:
    """Blocking: call it in a thread."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise bad_request(f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    check_sizes(data, max_items)
    ignored: list[str] = []
    try:
        body = model.model_validate(data, context={STRICT_FIELDS: strict_fields, IGNORED_FIELDS: ignored})
    except pydantic.ValidationError as exc:
        # Without the inputs: an error's input can be a whole array of millions of items.
        raise validation_error(exc.errors(include_input=False, include_url=False)) from None
    ignored = sorted(set(ignored))  # a name in several messages is named once
    if ignored:
        logger.warning("request %s: ignored unknown fields: %s", REQUEST_ID.get(), listed(ignored))
    return body, ignored


def check_sizes(data: dict[str, Any], max_items: int) -> None:
    """A 400 naming the first array or object longer than ``max_items``.
    Walks containers only, iteratively (the body's depth is the client's)."""
    stack: list[tuple[str, Any]] = [(key, value) for key, value in data.items()]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            children = value.items()
        elif isinstance(value, list):
            children = enumerate(value)
        else:
            continue
        if len(value) > max_items:
            param = path.split(".", 1)[0]
            raise bad_request(
                f"{path} has {len(value)} items, more than any field of a request may hold on this server "
                f"({max_items}: the context length or the largest --max-* limit)", param,
            )
        stack.extend((f"{path}.{key}", child) for key, child in children if isinstance(child, (dict, list)))


def name_ignored(response: Response, ignored: list[str]) -> None:
    """Tell the client which of its fields were not read."""
    if ignored:
        response.headers[IGNORED_FIELDS_HEADER] = listed(ignored)


def listed(names: list[str]) -> str:
    """The names as one line of printable ASCII (they are the client's text:
    no line breaks in a header or a log line), the first ``_MAX_LISTED`` of them."""
    shown = ", ".join(json.dumps(name)[1:-1] for name in names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def openapi_body(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: the body it reads itself, as FastAPI would describe a body parameter."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def describe_bodies(app: FastAPI, models: list[type[pydantic.BaseModel]]) -> None:
    """/openapi.json with ``models`` (and the models they hold) among its schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            # The arguments FastAPI's own openapi() passes that this app sets (servers: --root-path).
            schema = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                                 routes=app.routes, servers=app.servers)
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
