"""Run the app under uvicorn with a graceful SIGTERM / Ctrl-C shutdown.

On the first signal uvicorn closes the listening socket (no new
connections), and new requests on open keep-alive connections get 503; the
in-flight ones may finish within ``shutdown_timeout_s``, after which uvicorn
cancels them (their engine requests abort). Then the lifespan exit stops the
engine process.
"""
from __future__ import annotations

import logging
import signal
import socket
from types import FrameType
from typing import Any, Awaitable, Callable, MutableMapping, Optional

import uvicorn
from fastapi import FastAPI

from octavo.config import EngineConfig
from octavo.engine.engine_process import last_line
from octavo.server.app import build_app
from octavo.server.config import ServerConfig

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        state = getattr(self._app.state, "server", None)
        if state is not None and not state.shutting_down:
            state.shutting_down = True
            logger.info("shutting down: draining %d in-flight requests", state.client.num_in_flight)
        super().handle_exit(sig, frame)


def _exit_with(code: int) -> Callable[[int, Optional[FrameType]], None]:
    def handler(sig: int, frame: Optional[FrameType]) -> None:
        raise SystemExit(code)

    return handler


_Message = MutableMapping[str, Any]


class _StartupFailure:
    """A failed start (a bad model file, an engine that cannot load), kept for the command to report as
    its one ``octavo: error:`` line: Starlette hands uvicorn the whole traceback as the failure message,
    and uvicorn adds a line of its own. The traceback goes to the debug log, uvicorn's lines nowhere."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None

    def wrap(self, app: FastAPI) -> Callable[..., Awaitable[None]]:
        async def wrapped(scope: _Message, receive: Callable[[], Awaitable[_Message]],
                          send: Callable[[_Message], Awaitable[None]]) -> None:
            if scope["type"] != "lifespan":
                await app(scope, receive, send)
                return

            async def send_short(message: _Message) -> None:
                if message["type"] == "lifespan.startup.failed":
                    logger.debug("start-up traceback:\n%s", message.get("message"))
                    self.reason = last_line(message.get("message") or "")
                    message = {**message, "message": ""}
                await send(message)

            await app(scope, receive, send_short)

        return wrapped

    def filter(self, record: logging.LogRecord) -> bool:
        return self.reason is None or "startup failed" not in record.getMessage()

    def raise_if_failed(self) -> None:
        if self.reason is not None:
            raise ValueError(self.reason.removeprefix("ValueError: "))


def check_port_free(host: str, port: int) -> None:
    """Bind once before anything loads: a port in use is a one-line ``ValueError``
    at once, instead of uvicorn's bind error after the model has loaded."""
    if port == 0:  # any free port
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror} (is another server there? "
                             "choose another --port)") from None


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    check_port_free(server_config.host, server_config.port)
    # uvicorn re-raises the signal it drained on, through the handlers that
    # were installed before it: after a complete drain, SIGTERM exits 0 (a
    # clean stop for orchestrators) and Ctrl-C exits 130 without a traceback.
    signal.signal(signal.SIGTERM, _exit_with(0))
    signal.signal(signal.SIGINT, _exit_with(130))
    exit_code = 0
    server: Optional[_Server] = None

    def engine_gave_up(reason: str) -> None:
        # Stop serving (a graceful uvicorn exit; the in-flight requests have
        # failed already) and exit 1, so an orchestrator restarts the server.
        nonlocal exit_code
        exit_code = 1
        logger.error("exiting: %s", reason)
        if server is not None:
            server.should_exit = True

    app = build_app(engine_config, server_config, engine_gave_up)
    failure = _StartupFailure()
    config = uvicorn.Config(
        failure.wrap(app),
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=server_config.shutdown_timeout_s,
        lifespan="on",
        root_path=server_config.root_path,
        ssl_keyfile=server_config.ssl_keyfile,
        ssl_certfile=server_config.ssl_certfile,
        access_log=server_config.access_log,
    )
    server = _Server(config, app)
    logging.getLogger("uvicorn.error").addFilter(failure.filter)
    try:
        server.run()
    except SystemExit:  # uvicorn exits 3 on a failed start; the reason is ours to report
        failure.raise_if_failed()
        raise
    failure.raise_if_failed()
    if exit_code:
        raise SystemExit(exit_code)
