"""Work that stops when its client hangs up: what a request started (engine
requests on a replica, the upstream call in the gateway) is cancelled as soon
as nobody waits for its answer."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

from fastapi import Request

from octavo.openai.errors import APIError

T = TypeVar("T")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client goes away first: then ``work`` is
    cancelled and a 499 (nginx's "client closed request") ends the handler.
    Nobody reads that answer; it ends the handler's task without a traceback."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise APIError(499, "client disconnected")
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
