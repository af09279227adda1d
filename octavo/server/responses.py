"""POST /v1/responses: OpenAI's Responses API, its text subset, on the chat path.

A request becomes a chat completion request (``instructions`` a system
message, ``input`` the messages, ``text.format`` the response format), so the
chat template, the sampling parameters and structured output are the chat
endpoint's own; only the envelope differs. Errors name this API's fields
(``input``, ``max_output_tokens``, ``text``).

Nothing is stored: ``store`` true is a 400 (OpenAI's default is true, so a
request that leaves ``store`` out is served as if it said false), and so is
``previous_response_id``, since no earlier response can be found. Tools,
reasoning and the other item types are refused by name.

Streaming sends the API's events in its order, each ``event: <type>`` with a
JSON ``data`` carrying ``type`` and a ``sequence_number`` counted from 0:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., then
response.output_text.done, response.content_part.done,
response.output_item.done and response.completed (response.incomplete when
the output hit max_output_tokens). There is no [DONE] marker."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Optional

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from octavo.openai.disconnect import until_disconnected
from octavo.openai.errors import APIError, bad_request
from octavo.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    JsonSchemaFormat,
    ResponseFormat,
)
from octavo.openai.responses import (
    InputMessage,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from octavo.outputs import RequestOutput
from octavo.sampling_params import SamplingParams
from octavo.server.chat import prepare_chat
from octavo.server.admission import Reservation
from octavo.server.state import ServerState
from octavo.server.streams import collect, primed, sse_response

# OpenAI's limits on metadata.
_MAX_METADATA = 16
_MAX_METADATA_KEY = 64
_MAX_METADATA_VALUE = 512
# Chat field (as the chat path names it in errors) -> this API's field.
_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}
# SamplingParams field -> this API's field, for errors from the engine.
_API_NAMES = {"max_tokens": "max_output_tokens", "structured_outputs": "text"}


async def create_response(req: ResponsesRequest, raw: Request, state: ServerState, reservation: Reservation) -> Response:
    state.check_model(req.model)
    state.check_task(embeddings=False)
    state.check_engine()
    chat = _as_chat(req)
    with _renamed_fields():
        state.config.limits.check(chat)
        prompt_ids, params, _ = await asyncio.to_thread(prepare_chat, chat, state)
    state.admit(reservation, 1, req.priority)
    shell = _Shell(req, state.model_name, params, len(prompt_ids))
    stream = state.generate(prompt_ids, params, req.priority, _API_NAMES)
    if req.stream:
        stream = await primed(raw, stream)
        events = _EventWriter()
        return sse_response(events.stream(shell, stream), error_event=events.error, done=None)
    out = await until_disconnected(raw, collect(stream, prompt_ids))
    c = out.outputs[0]
    body = shell.response(c.text, c.finish_reason, len(c.token_ids), out.num_cached_tokens)
    return Response(body.model_dump_json(), media_type="application/json")


def _as_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this one means (400s for what has no place there)."""
    if req.store:
        raise bad_request("store: this server keeps no responses; leave store out or set it to false", "store")
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id: this server keeps no responses (store is not supported), so "
                          "there is none to continue; send the earlier turns in input instead", "previous_response_id")
    _check_metadata(req.metadata)
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise bad_request("input must not be empty", "input")
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    for item in items:
        content = item.content
        if not isinstance(content, str):  # parts are joined as the chat endpoint joins its text parts
            content = [ContentPart(type="text", text=p.text) for p in content]
        # OpenAI's "developer" turns are what chat templates call system turns.
        role = "system" if item.role == "developer" else item.role
        messages.append(ChatMessage(role=role, content=content))
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, user=req.user, priority=req.priority,
        response_format=_response_format(req.text),
    )


def _response_format(text: Optional[TextConfig]) -> Optional[ResponseFormat]:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise bad_request("text.format.schema is required when text.format.type is json_schema", "text")
    schema = JsonSchemaFormat(name=fmt.name, description=fmt.description, json_schema=fmt.json_schema,
                              strict=fmt.strict)
    return ResponseFormat(type="json_schema", json_schema=schema)


def _check_metadata(metadata: Optional[dict[str, str]]) -> None:
    if metadata is None:
        return
    if len(metadata) > _MAX_METADATA:
        raise bad_request(f"metadata may hold at most {_MAX_METADATA} pairs, got {len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY or len(value) > _MAX_METADATA_VALUE:
            raise bad_request(f"metadata: keys may have at most {_MAX_METADATA_KEY} characters and values "
                              f"{_MAX_METADATA_VALUE}; {key[:_MAX_METADATA_KEY]!r} is longer", "metadata")


@contextlib.contextmanager
def _renamed_fields() -> Iterator[None]:
    """Within the block, a 400 of the chat path names this API's field."""
    try:
        yield
    except APIError as exc:
        if exc.param in _FIELD_NAMES:
            new = _FIELD_NAMES[exc.param]
            exc.message = exc.message.replace(exc.param, new)
            exc.param = new
        raise


@dataclass
class _Shell:
    """What every response object of one request shares."""

    req: ResponsesRequest
    model: str
    params: SamplingParams
    num_prompt_tokens: int
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    item_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, text: Optional[str], finish_reason: Optional[str] = None, num_output_tokens: int = 0,
        num_cached_tokens: int = 0,
    ) -> ResponseObject:
        """The response object; ``text`` None: still in progress, no output yet."""
        req = self.req
        status, output, usage, incomplete = "in_progress", [], None, None
        if text is not None:
            status = "incomplete" if finish_reason == "length" else "completed"
            output = [self.message(text, status)]
            usage = ResponseUsage(
                input_tokens=self.num_prompt_tokens, input_tokens_details={"cached_tokens": num_cached_tokens},
                output_tokens=num_output_tokens, output_tokens_details={"reasoning_tokens": 0},
                total_tokens=self.num_prompt_tokens + num_output_tokens,
            )
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, incomplete_details=incomplete,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, model=self.model, output=output,
            temperature=self.params.temperature, top_p=self.params.top_p, text={"format": fmt or {"type": "text"}},
            usage=usage, user=req.user, metadata=req.metadata or {},
        )

    def message(self, text: Optional[str], status: str) -> OutputMessage:
        content = [OutputText(text=text)] if text is not None else []
        return OutputMessage(id=self.item_id, status=status, content=content)


class _EventWriter:
    """Numbers one stream's events; the error event takes the next number."""

    def __init__(self) -> None:
        self._numbers = itertools.count()

    def event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": next(self._numbers)}
        body.update({k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in data.items()})
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def error(self, err: APIError) -> str:
        return self.event("error", code=err.code, message=err.message, param=err.param)

    async def stream(self, shell: _Shell, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        item = {"item_id": shell.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=shell.response(None))
        yield self.event("response.in_progress", response=shell.response(None))
        yield self.event("response.output_item.added", output_index=0, item=shell.message(None, "in_progress"))
        yield self.event("response.content_part.added", **item, part=OutputText(text=""))
        parts: list[str] = []
        num_tokens, finish_reason, num_cached = 0, None, 0
        async for out in outputs:  # deltas of the one sequence
            num_cached = out.num_cached_tokens
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                finish_reason = c.finish_reason or finish_reason
                if c.text:
                    parts.append(c.text)
                    yield self.event("response.output_text.delta", **item, delta=c.text, logprobs=[])
        text = "".join(parts)
        final = shell.response(text, finish_reason, num_tokens, num_cached)
        yield self.event("response.output_text.done", **item, text=text, logprobs=[])
        yield self.event("response.content_part.done", **item, part=OutputText(text=text))
        yield self.event("response.output_item.done", output_index=0, item=final.output[0])
        done = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield self.event(done, response=final)
