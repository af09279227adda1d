"""A stand-in replica that answers every completion with the body it received
(in the ``text`` field), for tests of what the gateway sends upstream and of
replica behaviour that a real one shows only under load or failure.

A prompt ``sleep:SECONDS`` answers after that long; a streamed prompt
``engine dies`` ends its stream as a replica whose engine died under it does
(an error event, then [DONE]); with ``ECHO_OVERLOADED=1`` in the environment
every completion is the 503 of a replica whose queue is full.

Run: python -m uvicorn tests.gateway.echo_upstream:app --port PORT"""
from __future__ import annotations

import asyncio
import json
import os
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

app = FastAPI()
OVERLOADED = os.environ.get("ECHO_OVERLOADED") == "1"
OVERLOADED_RETRY_AFTER = "7"


@app.get("/health")
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@app.get("/metrics")
async def metrics() -> PlainTextResponse:
    return PlainTextResponse("")


@app.post("/v1/completions")
async def completions(request: Request) -> Response:
    received = await request.json()
    if OVERLOADED:
        error = {"message": "too many requests waiting; retry later", "type": "service_unavailable_error",
                 "param": None, "code": "overloaded"}
        return JSONResponse({"error": error}, 503, headers={"Retry-After": OVERLOADED_RETRY_AFTER})
    prompt = received.get("prompt")
    if isinstance(prompt, str) and prompt.startswith("sleep:"):
        await asyncio.sleep(float(prompt.removeprefix("sleep:")))
    text = json.dumps(received)
    if received.get("stream"):
        return StreamingResponse(_events(text, prompt == "engine dies"), media_type="text/event-stream")
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return JSONResponse({"id": "echo", "object": "text_completion", "model": "echo", "usage": usage,
                         "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})


async def _events(text: str, engine_dies: bool) -> AsyncIterator[str]:
    chunk = {"id": "echo", "object": "text_completion", "model": "echo", "usage": None,
             "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    yield f"data: {json.dumps(chunk)}\n\n"
    if engine_dies:
        error = {"message": "the engine failed while serving this request", "type": "service_unavailable_error",
                 "param": None, "code": "engine_dead"}
        yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"
