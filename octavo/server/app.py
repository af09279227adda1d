"""The FastAPI app: routes, middlewares, and the engine's lifetime (lifespan)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import octavo
from octavo.config import EngineConfig
from octavo.engine.async_client import AsyncEngineClient
from octavo.engine.restart_policy import RestartPolicy
from octavo.openai.embeddings import EmbeddingRequest
from octavo.openai.errors import bad_request, error_body, install_error_handlers
from octavo.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from octavo.openai.responses import ResponsesRequest
from octavo.server.admission import Admission, ReleasingResponse, Reservation
from octavo.server.bodies import describe_bodies, name_ignored, openapi_body, read_body
from octavo.server.chat import create_chat_completion, render_messages, template_tools
from octavo.server.completions import create_completion
from octavo.server.config import ServerConfig
from octavo.server.embeddings import create_embedding
from octavo.server.engine_collector import EngineSource
from octavo.server.metrics import ServerMetrics, instrument_http, new_registry
from octavo.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from octavo.server.responses import create_response
from octavo.server.state import ServerState
from octavo.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_STARTED = time.time()

Body = TypeVar("Body", bound=BaseModel)


def build_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    on_engine_gave_up: Optional[Callable[[str], None]] = None,
) -> FastAPI:
    """The engine process starts with the app (lifespan) and stops after
    the HTTP server has drained. ``on_engine_gave_up`` is called when the
    engine died more often than ``server_config`` allows restarts.
    ``ValueError`` when the tokenizer or the chat template is unusable."""
    # Before anything starts: a bad tokenizer folder or a chat template that
    # does not compile fails `octavo serve` at once with one line, instead
    # of every chat request after the engine loaded.
    tokenizer = load_tokenizer(engine_config, server_config)
    registry = new_registry()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        policy = RestartPolicy(server_config.engine_max_restarts, server_config.engine_restart_window_s)
        client = await AsyncEngineClient.start(
            engine_config, server_config.engine_start_timeout_s, policy, on_engine_gave_up,
            server_config.engine_step_timeout_s,
        )
        try:
            source = EngineSource(client.info.model_name, engine_config.cache, lambda: client.stats,
                                  lambda: client.num_restarts, lambda: client.engine_pid,
                                  server_config.moe_expert_metrics)
            metrics = ServerMetrics(registry, source, client.info.max_model_len)
            waiting = server_config.max_waiting_requests
            batch = engine_config.scheduler.max_num_seqs
            admission = Admission(None if waiting is None else batch + waiting, batch)
            app.state.server = ServerState(client, tokenizer, server_config, metrics, admission)
            info = client.info
            task = "embed" if info.pooler is not None else "generate"
            pooling = f", {info.pooler.pooling_type} pooling" if info.pooler is not None else ""
            logger.info("serving %s (%s%s): up to %d sequences at once, context %d tokens; API key %s",
                        info.model_name, task, pooling, engine_config.scheduler.max_num_seqs, info.max_model_len,
                        "required" if server_config.api_keys else "not required (no --api-key)")
            yield
        finally:
            await client.shutdown()

    app = FastAPI(title="Octavo", version=octavo.__version__, lifespan=lifespan)
    install_error_handlers(app)
    _add_routes(app)
    # Added last = outermost: oversized bodies are refused before anything
    # else, and every response, refusals included, carries a request id.
    route_keys = {"/metrics": server_config.metrics_api_keys} if server_config.metrics_api_keys else {}
    if server_config.api_keys or route_keys:
        app.add_middleware(
            APIKeyMiddleware,
            api_keys=server_config.api_keys,
            public_routes=server_config.public_routes,
            route_keys=route_keys,
        )
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_config.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    # Outside the others: their refusals (401, 413) and 500s are counted too.
    instrument_http(app, registry)
    if server_config.allowed_origins:
        # Outermost: a browser's preflight (OPTIONS, no API key) is answered here.
        app.add_middleware(
            CORSMiddleware, allow_origins=list(server_config.allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    return app


def load_tokenizer(engine_config: EngineConfig, server_config: ServerConfig) -> Tokenizer:
    """The model's tokenizer with the chat template the server will use, compiled."""
    tokenizer = Tokenizer(engine_config.model.tokenizer or engine_config.model.model)
    if server_config.chat_template is not None:
        tokenizer.chat_template = server_config.chat_template
    try:
        tokenizer.compile_chat_template()
    except ValueError as exc:
        where = "--chat-template" if server_config.chat_template is not None else "the model's chat template"
        raise ValueError(f"{where}: {exc}") from None
    return tokenizer


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _body(request: Request, model: type[Body]) -> tuple[Body, list[str]]:
    state = _state(request)
    max_items = state.config.limits.max_items(state.max_model_len)
    return await read_body(request, model, max_items, state.config.strict_request_fields)


Handler = Callable[[Any, Request, ServerState, Reservation], Awaitable[Response]]


def _admitted(model: type[BaseModel], handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """The route of a request for the engine: its place is reserved before
    anything is awaited and released when its response is over, whatever ends it."""

    async def route(request: Request) -> Response:
        state = _state(request)
        reservation = state.reserve()
        try:
            body, ignored = await _body(request, model)
            response = await handler(body, request, state, reservation)
        except BaseException:
            reservation.release()
            raise
        name_ignored(response, ignored)
        return ReleasingResponse(response, reservation)

    return route


# (path, body, handler, route name) of the routes that run engine requests.
_ENGINE_ROUTES: tuple[tuple[str, type[BaseModel], Handler, str], ...] = (
    ("/v1/completions", CompletionRequest, create_completion, "completions"),
    ("/v1/chat/completions", ChatCompletionRequest, create_chat_completion, "chat_completions"),
    ("/v1/responses", ResponsesRequest, create_response, "responses"),
    ("/v1/embeddings", EmbeddingRequest, create_embedding, "embeddings"),
)


def _add_routes(app: FastAPI) -> None:
    # Each route reads its own body (octavo/server/bodies.py); /openapi.json still describes it.
    describe_bodies(app, [model for _, model, _, _ in _ENGINE_ROUTES] + [TokenizeRequest, DetokenizeRequest])
    for path, model, handler, name in _ENGINE_ROUTES:
        app.add_api_route(path, _admitted(model, handler), methods=["POST"], name=name,
                          openapi_extra=openapi_body(model))

    def card(state: ServerState, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": int(_STARTED),
            "owned_by": "octavo",
            "root": state.model_name,  # not the model's path: clients need not know the server's disks
            "max_model_len": state.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state = _state(request)
        return JSONResponse({"object": "list", "data": [card(state, n) for n in state.model_names]})

    @app.get("/v1/models/{model_id:path}")  # names may hold slashes ("org/model")
    async def model(model_id: str, request: Request) -> JSONResponse:
        state = _state(request)
        state.check_model(model_id)
        return JSONResponse(card(state, model_id))

    @app.get("/health")
    async def health(request: Request) -> Response:
        state = _state(request)
        if not state.client.is_alive:
            body = error_body(503, f"the engine is not running ({state.client.dead_reason})", code="engine_dead")
            return JSONResponse(body, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": octavo.__version__})

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> JSONResponse:
        state = _state(request)
        body, ignored = await _body(request, TokenizeRequest)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("set exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            state.config.limits.check_messages(body.messages, body.tools)
            text = await asyncio.to_thread(
                render_messages, body.messages, state, body.add_generation_prompt, body.chat_template_kwargs,
                body.chat_template, continue_final_message=body.continue_final_message,
                tools=template_tools(body.tools),
            )
            ids = await asyncio.to_thread(state.tokenizer.encode, text, False)  # the template writes BOS
        else:
            ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt, body.add_special_tokens)
        response = JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})
        name_ignored(response, ignored)
        return response

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        state = _state(request)
        body, ignored = await _body(request, DetokenizeRequest)
        state.check_model(body.model)
        text = await asyncio.to_thread(_detokenized, state, body.tokens)  # megabytes of ids take a while
        response = JSONResponse({"prompt": text})
        name_ignored(response, ignored)
        return response


def _detokenized(state: ServerState, tokens: list[int]) -> str:
    vocab = state.client.info.vocab_size
    bad = [t for t in tokens if not (0 <= t < vocab)]
    if bad:
        raise bad_request(f"tokens contains ids outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
    return state.tokenizer.decode(tokens, False)

