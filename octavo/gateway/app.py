"""The gateway's HTTP app: the OpenAI routes of ``octavo serve``, forwarded
to the replicas, plus /health, /metrics and the admin API.

A /v1 request goes: API key -> headers checked and body read within bounds
(intake.py) -> JSON parsed and validated with the server's own request models
(a bad body is answered here, exactly as a replica would, without using one)
-> rate limits -> response cache -> route and forward. Every other route of
an API key is rate limited too.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

import anyio
import httpx
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from octavo.gateway.cache import MemoryCache, RedisCache, ResponseCache, cache_key, is_deterministic
from octavo.gateway.config import GatewayConfig, KeyConfig
from octavo.gateway.health import discovery_loop, probe_loop
from octavo.gateway.intake import header_value, parse_json, read_body
from octavo.gateway.kv_index import KVEventSubscriber, KVIndex
from octavo.gateway.metrics import GatewayMetrics
from octavo.gateway.proxy import Forwarder, NoReplica, split_events
from octavo.gateway.ratelimit import Buckets, MemoryBuckets, RateLimiter, RedisBuckets, retry_after_header
from octavo.gateway.replica_url import normalize_url
from octavo.gateway.replicas import ReplicaSet
from octavo.gateway.routing import KVAware, LeastLoad, Policy, PrefixAffinity, RoundRobin, RouteInput, Session
from octavo.gateway.usage import StreamUsage, body_tokens, reservation
from octavo.openai.disconnect import until_disconnected
from octavo.openai.embeddings import EmbeddingRequest
from octavo.openai.errors import APIError, bad_request, error_body, error_response, validation_error
from octavo.openai.protocol import ChatCompletionRequest, CompletionRequest
from octavo.openai.responses import ResponsesRequest
from octavo.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
}
# Routes whose streams the gateway may ask for a usage chunk (stream_options); a
# Responses stream always ends with its usage, and refuses stream_options.
_USAGE_CHUNK_PATHS = ("/v1/completions", "/v1/chat/completions")
# A stream is whole (and may be cached) once its last event has passed.
_STREAM_ENDS = (b"data: [DONE]", b"event: response.completed", b"event: response.incomplete")
# Events of a stream that failed (an engine that died under it, a replica lost mid-stream): never replayed.
_STREAM_ERRORS = (b'data: {"error"', b"event: error", b"event: response.failed")
# Fields that do not change a response's content: left out of the cache key.
_NOT_IN_CACHE_KEY = ("priority", "user")
_FORWARDED_HEADERS = ("x-request-id", "accept")


class Gateway:
    """Everything a request needs, built once in the app's lifespan."""

    def __init__(self, config: GatewayConfig, redis: Any) -> None:
        self.config = config
        self.replicas = ReplicaSet(config.breaker)
        for url in config.replicas:
            self.replicas.add(url)
        self.metrics = GatewayMetrics(self.replicas)
        self.keys: dict[str, KeyConfig] = {k.key: k for k in config.keys}
        self.tokenizer = Tokenizer(config.tokenizer) if config.routing == "kv-aware" else None
        self.kv_index = KVIndex()
        self.policy = self._policy()
        limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout)
        auth = {"Authorization": f"Bearer {config.upstream_api_key}"} if config.upstream_api_key else {}
        self.forwarder = Forwarder(self.client, self.replicas, self.policy, self.metrics, auth)
        self.cache: Optional[ResponseCache] = None
        if config.cache.enabled:
            self.cache = RedisCache(redis, config.cache) if redis is not None else MemoryCache(config.cache)
        buckets: Buckets = RedisBuckets(redis) if redis is not None else MemoryBuckets()
        self.limiter = RateLimiter(buckets)

    def _policy(self) -> Policy:
        c = self.config
        if c.routing == "round-robin":
            return RoundRobin()
        if c.routing == "prefix":
            return PrefixAffinity(c.prefix_chunk_bytes, c.max_imbalance)
        if c.routing == "session":
            return Session(c.max_imbalance)
        if c.routing == "kv-aware":
            return KVAware(self.kv_index, c.block_size, c.max_imbalance)
        return LeastLoad()


def build_app(config: GatewayConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = None
        if config.redis_url:
            import redis.asyncio as aioredis  # optional: pip install 'octavo[gateway]'

            redis = aioredis.from_url(config.redis_url)
            await redis.ping()  # a wrong URL fails the start, not the first request
        gw = Gateway(config, redis)
        app.state.gateway = gw
        tasks = [asyncio.create_task(probe_loop(gw.client, gw.replicas, gw.forwarder.auth_headers,
                                                config.probe_interval_s, config.probe_timeout_s))]
        if config.discovery_dns:
            tasks.append(asyncio.create_task(discovery_loop(config.discovery_dns, config.discovery_port,
                                                            gw.replicas, config.discovery_interval_s)))
        subscribers = []
        if config.kv_events:
            import zmq.asyncio

            ctx = zmq.asyncio.Context()
            subscribers = [KVEventSubscriber(ctx, gw.kv_index, gw.replicas.add(url).url, endpoint)
                           for url, endpoint in config.kv_events.items()]
        # Startup's objects (FastAPI, pydantic, prometheus) never die: out of the
        # collector's sight, collections get cheap enough to stop showing up in per-request latency.
        gc.freeze()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for sub in subscribers:
                await sub.close()
            if subscribers:
                ctx.term()
            await gw.client.aclose()
            if redis is not None:
                await redis.aclose()

    app = FastAPI(title="Octavo gateway", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    for path in _MODELS:
        app.add_api_route(path, _generate_route(path), methods=["POST"])
    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, _passthrough_route(path), methods=["POST"])
    app.add_api_route("/v1/models", _passthrough_route("/v1/models"), methods=["GET"])
    app.add_api_route("/version", _passthrough_route("/version"), methods=["GET"])
    _add_own_routes(app)
    return app


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _api_key(gw: Gateway, request: Request) -> Optional[KeyConfig]:
    """The caller's key config; None when the gateway has no keys (open)."""
    if not gw.keys:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = gw.keys.get(token.strip()) if scheme.lower() == "bearer" else None
    if key is None:
        raise APIError(401, "missing or unknown API key", code="invalid_api_key")
    return key


def _forward_headers(request: Request) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    for name in _FORWARDED_HEADERS:
        value = header_value(request, name)
        if value is not None:
            headers[name] = value
    return headers


def _parse(raw: bytes, path: str) -> dict[str, Any]:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        _MODELS[path].model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return data


def _joined(content: Any) -> str:
    """A message's content as one string: text parts joined as the replica joins them."""
    if isinstance(content, list):
        return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


def _plain_messages(data: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages a request means, as templates take them: a chat
    request's own, or a Responses request's ``instructions`` and ``input``
    items in the order octavo/server/responses.py gives them to the template."""
    if "messages" in data:
        return [{"role": m.get("role") or "", "content": _joined(m.get("content"))} for m in data["messages"]]
    items = data["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages = [{"role": "system", "content": data["instructions"]}] if data.get("instructions") is not None else []
    for item in items:
        role = item.get("role") or ""
        messages.append({"role": "system" if role == "developer" else role, "content": _joined(item.get("content"))})
    return messages


def _is_chat(path: str) -> bool:
    return path in ("/v1/chat/completions", "/v1/responses")


def _first_prompt(data: dict[str, Any], path: str) -> Any:
    """A completion's or embedding's prompt (the first of a batch): text or token ids."""
    prompt = data.get("input" if path == "/v1/embeddings" else "prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return prompt


def _prompt_text(data: dict[str, Any], path: str) -> str:
    if _is_chat(path):
        return "".join(f"{m['role']}\n{m['content']}\n" for m in _plain_messages(data))
    prompt = _first_prompt(data, path)
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _token_ids(tokenizer: Tokenizer, data: dict[str, Any], path: str) -> list[int]:
    """The prompt as the replica tokenizes it (the first prompt of a batch)."""
    if _is_chat(path):
        try:
            text = tokenizer.apply_chat_template(_plain_messages(data), add_generation_prompt=data.get("add_generation_prompt", True))
        except (ValueError, TypeError):
            return []  # the replica answers the error; routing needs no ids for that
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = _first_prompt(data, path)
    if isinstance(prompt, str):
        # Embeddings take add_special_tokens from the request (default on), as completions always do.
        return tokenizer.encode(prompt, add_special_tokens=data.get("add_special_tokens", True))
    return list(prompt or [])


async def _route_input(gw: Gateway, request: Request, data: dict[str, Any], path: str) -> RouteInput:
    route = RouteInput()
    routing = gw.config.routing
    if routing == "prefix":
        route.prompt_bytes = _prompt_text(data, path).encode("utf-8", "surrogatepass")
    elif routing == "session":
        route.session = request.headers.get(gw.config.session_header) or data.get("user")
    elif routing == "kv-aware" and gw.tokenizer is not None:
        # Long prompts take milliseconds to tokenize: off the event loop.
        route.token_ids = await asyncio.to_thread(_token_ids, gw.tokenizer, data, path)
    return route


def _generate_route(path: str):
    async def route(request: Request) -> Response:
        gw = _gateway(request)
        start = time.monotonic()
        key = _api_key(gw, request)
        headers = _forward_headers(request)
        raw = await read_body(request, gw.config.max_body_bytes, gw.config.body_timeout_s)
        data = _parse(raw, path)
        stream = bool(data.get("stream"))
        cache_id = _cache_id(gw, request, key, path, data)  # of the body as the client sent it
        charge = None
        usage = StreamUsage()
        if key is not None:
            charge = await _admit(gw, key, reservation(path, data, raw))
            if isinstance(charge, Response):
                return charge
            raw, usage = _for_key(data, raw, key, stream and path in _USAGE_CHUNK_PATHS)
        if cache_id is not None:
            hit = await gw.cache.get(cache_id)
            gw.metrics.cache.labels("hit" if hit is not None else "miss").inc()
            if hit is not None:
                if charge is not None:
                    await charge.settle(0)
                gw.metrics.added_latency.observe(time.monotonic() - start)
                return _cached_response(hit, stream)
        route_input = await _route_input(gw, request, data, path)
        try:
            # A client that leaves first gets a 499 nobody reads; the upstream call is closed with it
            # (an unsettled charge keeps its reservation: what the replica did is not known).
            upstream = await until_disconnected(
                request, gw.forwarder.send("POST", path, raw, headers, route_input, stream)
            )
        except NoReplica:
            if charge is not None:
                await charge.settle(0)
            gw.metrics.unavailable.inc()
            return _unavailable(gw.config)
        response_headers = {**upstream.headers, "x-octavo-replica": upstream.replica.url}
        gw.metrics.added_latency.observe(max(0.0, time.monotonic() - start - upstream.waited_s))
        if upstream.events is None:
            if charge is not None:
                await charge.settle(body_tokens(upstream.body) if upstream.status == 200 else 0)
            if upstream.status == 200 and cache_id is not None:
                await gw.cache.put(cache_id, upstream.body)
            return Response(upstream.body, upstream.status, headers=response_headers)
        return StreamingResponse(_tee(gw, upstream.events, charge, cache_id, usage), headers=response_headers,
                                 media_type="text/event-stream")

    return route


@dataclass
class _Charge:
    """An admitted request of a rate-limited key: its token reservation, settled once when it ends."""

    limiter: RateLimiter
    key: KeyConfig
    reserve: int
    settled: bool = False

    async def settle(self, used: Optional[int]) -> None:
        """``used``: the tokens the request cost; None (not known: abandoned
        before any usage came back) leaves the reservation charged."""
        if self.settled or used is None:
            return
        self.settled = True
        # Also when the request's task is being cancelled (a client that hung up mid-stream).
        with anyio.CancelScope(shield=True):
            await self.limiter.settle(self.key, self.reserve, used)


async def _admit(gw: Gateway, key: KeyConfig, reserve: int) -> Union[_Charge, Response]:
    """The key's charge for this request, or the 429 refusing it."""
    rejection = await gw.limiter.admit(key, reserve)
    if rejection is not None:
        gw.metrics.rate_limited.labels(rejection.limit).inc()
        return _rate_limited(rejection.limit, rejection.retry_after_s)
    return _Charge(gw.limiter, key, reserve)


def _cache_id(
    gw: Gateway, request: Request, key: Optional[KeyConfig], path: str, data: dict[str, Any]
) -> Optional[str]:
    """The request's cache entry, or None when it may not be cached."""
    if gw.cache is None or "no-cache" in request.headers.get("cache-control", ""):
        return None
    # An embedding is a function of its input alone: always cacheable.
    if path != "/v1/embeddings" and not is_deterministic(data):
        return None
    scope = key.cache_scope if key is not None else ""
    return cache_key(scope, path, {k: v for k, v in data.items() if k not in _NOT_IN_CACHE_KEY})


def _for_key(data: dict[str, Any], raw: bytes, key: KeyConfig, usage_chunk: bool) -> tuple[bytes, StreamUsage]:
    """The body as sent upstream for this key: its priority class and, for a
    stream that has usage chunks (``usage_chunk``) of a key with a token
    budget, usage on every chunk (so that a stream the client abandons is
    charged what was generated until then). Returns the body and what of the
    stream's usage to hide again from the client."""
    changed = False
    if data.get("priority", 0) != key.priority:
        data["priority"] = key.priority
        changed = True
    usage = StreamUsage()
    if usage_chunk and key.tpm is not None:
        options = data.get("stream_options") or {}
        asked_final = bool(options.get("include_usage"))
        if not (asked_final and options.get("continuous_usage_stats")):
            data["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
            usage = StreamUsage(hide_final=not asked_final, hide_per_chunk=True)
            changed = True
    return (json.dumps(data).encode() if changed else raw), usage


async def _tee(
    gw: Gateway, events: AsyncIterator[bytes], charge: Optional[_Charge], cache_id: Optional[str], usage: StreamUsage
) -> AsyncIterator[bytes]:
    """Passes the stream on, keeping what the cache and the token budget need."""
    kept: list[bytes] = []
    size = 0
    whole = failed = False
    try:
        async for upstream_event in events:
            event = usage.see(upstream_event)
            if event is None:
                continue
            yield event
            failed = failed or event.startswith(_STREAM_ERRORS)
            whole = event.startswith(_STREAM_ENDS)
            if cache_id is not None and size <= gw.config.cache.max_bytes:
                kept.append(event)
                size += len(event)
    finally:
        # Whether the stream ended or its client left: charged for the tokens it has cost so far.
        if charge is not None:
            await charge.settle(usage.tokens)
    # Only a whole stream without an error is worth replaying.
    if cache_id is not None and whole and not failed and size <= gw.config.cache.max_bytes:
        await gw.cache.put(cache_id, b"".join(kept))


def _cached_response(hit: bytes, stream: bool) -> Response:
    headers = {"x-octavo-cache": "hit"}
    if not stream:
        return Response(hit, 200, headers=headers, media_type="application/json")

    async def replay() -> AsyncIterator[bytes]:
        for event in split_events(hit):
            yield event

    return StreamingResponse(replay(), headers=headers, media_type="text/event-stream")


def _rate_limited(limit: str, retry_after_s: float) -> JSONResponse:
    body = error_body(429, f"rate limit exceeded: {limit} per minute for this API key", code="rate_limit_exceeded")
    body["error"]["type"] = "rate_limit_error"
    body["error"]["param"] = None
    return JSONResponse(body, 429, headers={"Retry-After": retry_after_header(retry_after_s)})


def _unavailable(config: GatewayConfig, message: str = "no replica could serve the request (all failed or none "
                                                        "is available)") -> JSONResponse:
    body = error_body(503, message, code="no_replica_available")
    # The soonest a replica can be routable again: an open breaker's cool-down, then a probe.
    retry_after_s = config.breaker.cooldown_s + config.probe_interval_s
    return JSONResponse(body, 503, headers={"Retry-After": retry_after_header(retry_after_s)})


def _passthrough_route(path: str):
    async def route(request: Request) -> Response:
        gw = _gateway(request)
        key = _api_key(gw, request)
        headers = _forward_headers(request)
        raw = await read_body(request, gw.config.max_body_bytes, gw.config.body_timeout_s)
        if key is not None:
            # Counted as requests, and refused while the key's token budget is spent (they cost no tokens).
            charge = await _admit(gw, key, 0)
            if isinstance(charge, Response):
                return charge
        try:
            upstream = await gw.forwarder.send(request.method, path, raw, headers, RouteInput(), False)
        except NoReplica:
            gw.metrics.unavailable.inc()
            return _unavailable(gw.config)
        return Response(upstream.body, upstream.status, headers=upstream.headers)

    return route


def _admin(gw: Gateway, request: Request) -> None:
    expected = gw.config.admin_key
    if expected is None:
        raise APIError(404, "the admin API is off (set admin_key)")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # Digests compared: the time taken tells nothing of how much of the key matched.
    matched = hmac.compare_digest(_sha256(token.strip()), _sha256(expected))
    if scheme.lower() != "bearer" or not matched:
        raise APIError(401, "the admin API needs the admin key", code="invalid_api_key")


def _sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def _replica_view(gw: Gateway) -> list[dict[str, Any]]:
    return [
        {"url": r.url, "breaker": r.breaker.state.name.lower(), "load": r.load, "in_flight": r.in_flight,
         "kv_blocks": gw.kv_index.num_blocks(r.url)}
        for r in gw.replicas
    ]


def _add_own_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        gw = _gateway(request)
        if not gw.replicas.routable():
            return _unavailable(gw.config, "no replica is available")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_gateway(request).metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/replicas")
    async def list_replicas(request: Request) -> JSONResponse:
        gw = _gateway(request)
        _admin(gw, request)
        return JSONResponse({"replicas": _replica_view(gw)})

    @app.post("/admin/replicas")
    async def add_replica(request: Request) -> JSONResponse:
        gw = _gateway(request)
        _admin(gw, request)
        url = await _admin_url(gw, request)
        gw.replicas.add(url)
        return JSONResponse({"replicas": _replica_view(gw)})

    @app.delete("/admin/replicas")
    async def remove_replica(request: Request) -> JSONResponse:
        gw = _gateway(request)
        _admin(gw, request)
        url = await _admin_url(gw, request)
        if not gw.replicas.remove(url):
            raise APIError(404, f"no replica {url}", param="url")
        gw.kv_index.forget(url)
        return JSONResponse({"replicas": _replica_view(gw)})


async def _admin_url(gw: Gateway, request: Request) -> str:
    data = parse_json(await read_body(request, gw.config.max_body_bytes, gw.config.body_timeout_s))
    url = data.get("url") if isinstance(data, dict) else None
    if not isinstance(url, str) or not url.strip():
        raise bad_request("url: a replica URL is required", "url")
    try:
        return normalize_url(url)
    except ValueError as exc:
        raise bad_request(f"url: {exc}", "url") from None
