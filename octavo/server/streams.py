"""Async plumbing shared by the handlers: merging request streams, SSE."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable, Optional, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from octavo.openai.disconnect import until_disconnected
from octavo.openai.errors import APIError, sse_error
from octavo.outputs import OutputAccumulator, RequestOutput

T = TypeVar("T")


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as (stream index, item), in arrival order.

    Each stream is only advanced after its previous item was consumed, so an
    item that is updated in place is never seen twice. Leaving early closes
    every stream (which aborts their engine requests)."""
    if len(streams) == 1:
        # The common request (one prompt): its items as they come, without a
        # task and a wait per item, which cost several times the item itself.
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            with contextlib.suppress(Exception):
                await streams[0].aclose()  # type: ignore[attr-defined]
        return
    pending: dict[asyncio.Task[T], int] = {}

    def arm(i: int) -> None:
        pending[asyncio.ensure_future(anext(streams[i]))] = i

    try:
        for i in range(len(streams)):
            arm(i)
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                arm(i)
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]


async def primed(request: Request, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the stream's first item before the response starts, so that
    a request the engine refuses still gets a real error status (not an
    in-band error after a 200); returns an iterator over all items."""
    first = await until_disconnected(request, anext(stream))

    async def replay() -> AsyncIterator[T]:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            yield first
            async for item in stream:
                yield item

    return replay()


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_response(
    events: AsyncIterator[str],
    error_event: Callable[[APIError], str] = sse_error,
    done: Optional[str] = "data: [DONE]\n\n",
) -> StreamingResponse:
    """``error_event`` and ``done`` (None: nothing) end the stream: the
    Responses API has its own error event and no [DONE] marker."""

    async def body() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    yield event
        except APIError as err:
            # Headers (200) are gone already: report in-band, like OpenAI does.
            yield error_event(err)
        if done is not None:
            yield done

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def collect(stream: AsyncIterator[RequestOutput], prompt_ids: list[int]) -> RequestOutput:
    """The whole output of one request, from its deltas."""
    acc = OutputAccumulator(prompt_ids)
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for out in stream:
            acc.add(out)
    return acc.take()
