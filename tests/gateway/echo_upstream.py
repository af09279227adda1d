"""A stand-in replica that answers every completion with the body it received
(in the ``text`` field), for tests of what the gateway sends upstream.

Run: python -m uvicorn tests.gateway.echo_upstream:app --port PORT"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

app = FastAPI()


@app.get("/health")
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@app.get("/metrics")
async def metrics() -> PlainTextResponse:
    return PlainTextResponse("")


@app.post("/v1/completions")
async def completions(request: Request) -> JSONResponse:
    received = await request.json()
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return JSONResponse({"id": "echo", "object": "text_completion", "model": "echo", "usage": usage,
                         "choices": [{"index": 0, "text": json.dumps(received), "finish_reason": "stop"}]})
