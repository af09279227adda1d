"""``octavo run-batch -i requests.jsonl -o results.jsonl``: an OpenAI batch file, offline.

Input lines are ``{"custom_id", "method": "POST", "url", "body"}``, split on
newline bytes only (a U+2028 inside a JSON string is text, not a line break); output
lines ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``, one per input line, written and flushed as each request finishes
(match them by ``custom_id``): a crash loses no finished line. Each request
goes through the server's own app (``octavo.server.app.build_app``) over an
in-memory ASGI transport: the same validation, the same 400s, the same
response bodies as ``octavo serve``, with no socket and no copy of the request
handling. Lines are sent as the engine has room for them (``--max-num-seqs``
at a time), so the engine batches them continuously and ``--request-timeout``
counts a request's own time, not its wait behind the rest of the file.

A line that is not a valid batch request (not UTF-8, not JSON, nested too
deeply, not the batch shape) gets an ``error`` (and no response) and the
others run. A request the engine's death (or hang) failed is sent again once
the engine is back, up to ``MAX_ATTEMPTS`` times. The command exits non-zero
when any line failed on the server's side (a 5xx, or no response at all).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import IO, Any, AsyncIterator, Optional

import httpx
from fastapi import FastAPI
from tqdm import tqdm

from octavo.config import EngineConfig
from octavo.entrypoints.command_options import BatchConfig
from octavo.engine.engine_process import last_line
from octavo.server.app import build_app
from octavo.server.config import ServerConfig

# The batch endpoints of OpenAI's batch API this server may serve; the ones
# it has a route for are accepted (/v1/embeddings only with an embedding route).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Sends of one request when the engine died (or hung) under it: the engine
# restarts (--engine-max-restarts), so a request caught by one death runs on
# the next engine; one that meets three is likely what kills it.
MAX_ATTEMPTS = 3
_ENGINE_FAILURES = ("engine_dead", "engine_hung")


@dataclass
class BatchRequest:
    """One input line: a request to run, or the reason it cannot run."""

    line: int  # 1-based, for messages
    custom_id: Optional[str]
    url: str = ""
    body: Optional[dict[str, Any]] = None
    error: Optional[str] = None


def parse_line(raw: bytes, line: int, urls: tuple[str, ...]) -> BatchRequest:
    """A batch request from one JSONL line, or one carrying the error that names what is wrong."""
    try:
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return BatchRequest(line, None, error=f"line {line}: not valid UTF-8: {exc}")
    except RecursionError:
        return BatchRequest(line, None, error=f"line {line}: not valid JSON: nested too deeply")
    except json.JSONDecodeError as exc:
        return BatchRequest(line, None, error=f"line {line}: not valid JSON: {exc}")
    if not isinstance(item, dict):
        return BatchRequest(line, None, error=f"line {line}: expected a JSON object")
    custom_id = item.get("custom_id")
    req = BatchRequest(line, custom_id if isinstance(custom_id, str) else None)
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if req.custom_id is None:
        req.error = f"line {line}: custom_id must be a string"
    elif method != "POST":
        req.error = f"line {line}: method must be POST, got {method!r}"
    elif url not in urls:
        req.error = f"line {line}: url must be one of {', '.join(urls)}; got {url!r}"
    elif not isinstance(body, dict):
        req.error = f"line {line}: body must be a JSON object"
    elif body.get("stream"):
        req.error = f"line {line}: body.stream is not supported in a batch"
    else:
        req.url, req.body = url, body
    return req


def served_urls(app: FastAPI) -> tuple[str, ...]:
    paths = {getattr(route, "path", None) for route in app.routes}
    return tuple(url for url in BATCH_URLS if url in paths)


def run_batch(args: BatchConfig, engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """The command: read ``args.input_file``, write ``args.output_file``;
    SystemExit(1) when a line failed on the server's side."""
    lines = _read_lines(args.input_file)
    gave_up = asyncio.Event()
    app = build_app(engine_config, server_config, on_engine_gave_up=lambda reason: gave_up.set())
    urls = served_urls(app)
    requests = [parse_line(raw, i + 1, urls) for i, raw in enumerate(lines) if raw.strip()]
    failed = asyncio.run(_run(app, requests, args.output_file, engine_config.scheduler.max_num_seqs, gave_up))
    if failed:
        raise SystemExit(f"octavo: error: {failed} of {len(requests)} requests failed on the server's side; "
                         f"their lines in {args.output_file} say why")


async def _run(app: FastAPI, requests: list[BatchRequest], output_file: str, max_in_flight: int,
               gave_up: asyncio.Event) -> int:
    # The output is opened once the engine runs: a failed start leaves no empty results file behind.
    async with _started(app):
        if output_file == "-":
            return await run_requests(app, requests, sys.stdout, max_in_flight, gave_up)
        try:
            out = open(output_file, "w")
        except OSError as exc:
            raise ValueError(f"--output-file: cannot write {output_file}: {exc.strerror}") from None
        with out:
            return await run_requests(app, requests, out, max_in_flight, gave_up)


def _read_lines(path: str) -> list[bytes]:
    """The file's lines as bytes, split on newline bytes alone (str.splitlines also
    splits on U+2028 and other separators a JSON string may hold); each is
    decoded by itself, so one invalid UTF-8 line is that line's error."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else _read_bytes(path)
    except OSError as exc:
        raise ValueError(f"--input-file: cannot read {path}: {exc.strerror}") from None
    return [line.removesuffix(b"\r") for line in data.split(b"\n")]


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def run_requests(app: FastAPI, requests: list[BatchRequest], out: IO[str], max_in_flight: int,
                       gave_up: asyncio.Event) -> int:
    """Run the requests on the started app, ``max_in_flight`` at a time, and
    write each result line as soon as it is known; returns how many failed
    on the server's side."""
    # raise_app_exceptions=False: an unexpected failure is that request's 500, as the server answers it.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://octavo", timeout=None) as client:
        bar = tqdm(total=len(requests), unit="req", desc="run-batch", file=sys.stderr)
        answered = [0]  # generated tokens of the requests answered so far, from their usage
        failed = 0
        slots = asyncio.Semaphore(max_in_flight)
        started = time.monotonic()
        ticker = asyncio.create_task(_show_throughput(app, bar, started, answered))

        async def one(req: BatchRequest) -> None:
            nonlocal failed
            async with slots:
                result = await _attempts(app, client, req, gave_up)
            answered[0] += _completion_tokens(result)
            failed += _server_failed(result)
            out.write(json.dumps(result) + "\n")
            out.flush()
            bar.update(1)

        try:
            await asyncio.gather(*(one(req) for req in requests))
        finally:
            ticker.cancel()
            _set_throughput(app, bar, started, answered)
            bar.close()
    return failed


async def _attempts(app: FastAPI, client: httpx.AsyncClient, req: BatchRequest, gave_up: asyncio.Event
                    ) -> dict[str, Any]:
    """The request's result; sent again, once the engine is back, while an
    engine death or hang failed it (at most MAX_ATTEMPTS sends)."""
    engine = app.state.server.client
    result = await _result(client, req)
    for _ in range(MAX_ATTEMPTS - 1):
        if _engine_failure(result) is None:
            break
        while not engine.is_alive and not gave_up.is_set():
            await asyncio.sleep(0.2)
        if gave_up.is_set():
            break
        result = await _result(client, req)
    return result


def _engine_failure(result: dict[str, Any]) -> Optional[str]:
    """The error code when the engine's death or hang failed the request."""
    body = (result["response"] or {}).get("body")
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if code in _ENGINE_FAILURES else None


def _server_failed(result: dict[str, Any]) -> bool:
    """Failed on the server's side: a 5xx, or no response where the line was valid."""
    if result["response"] is None:
        return result["error"]["code"] != "invalid_request"
    return result["response"]["status_code"] >= 500


@contextlib.asynccontextmanager
async def _started(app: FastAPI) -> AsyncIterator[None]:
    """The app's lifespan (the engine process); a failed start is one line, as `octavo serve` reports it."""
    lifespan = app.router.lifespan_context(app)
    try:
        await lifespan.__aenter__()
    except Exception as exc:
        raise ValueError(f"start-up failed: {last_line(f'{type(exc).__name__}: {exc}')}") from None
    try:
        yield
    finally:
        await lifespan.__aexit__(None, None, None)


async def _result(client: httpx.AsyncClient, req: BatchRequest) -> dict[str, Any]:
    result: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.custom_id,
                              "response": None, "error": None}
    if req.error is not None:
        result["error"] = {"code": "invalid_request", "message": req.error}
        return result
    try:
        response = await client.post(req.url, json=req.body)
    except Exception as exc:  # noqa: BLE001  one request's failure is that line's error only
        result["error"] = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
        return result
    try:
        body = response.json()
    except ValueError:  # not JSON: whatever the server said, as text
        body = response.text
    result["response"] = {"status_code": response.status_code,
                          "request_id": response.headers.get("x-request-id"), "body": body}
    return result


def _completion_tokens(result: dict[str, Any]) -> int:
    body = (result["response"] or {}).get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    return (usage.get("completion_tokens") or 0) if isinstance(usage, dict) else 0


async def _show_throughput(app: FastAPI, bar: tqdm, started: float, answered: list[int]) -> None:
    while True:
        await asyncio.sleep(0.5)
        _set_throughput(app, bar, started, answered)


def _set_throughput(app: FastAPI, bar: tqdm, started: float, answered: list[int]) -> None:
    """Generated tokens per second since the requests were sent: the engine's
    counter while requests run (it lags by up to a stats interval), at least
    what the answered requests' usage adds up to."""
    elapsed = time.monotonic() - started
    if elapsed <= 0:
        return
    tokens = max(app.state.server.client.stats.generation_tokens, answered[0])
    bar.set_postfix_str(f"{tokens} tokens, {tokens / elapsed:.1f} tok/s", refresh=True)
