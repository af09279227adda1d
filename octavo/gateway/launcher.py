"""Runs the gateway's app under uvicorn until SIGINT/SIGTERM."""
from __future__ import annotations

import uvicorn

from octavo.gateway.app import build_app
from octavo.gateway.config import GatewayConfig
from octavo.gateway.http_protocol import protocol
from octavo.log import configure_logging


def run(config: GatewayConfig) -> None:
    # httpx's line per upstream request is quieted by configure_logging: it would cost more than the
    # gateway's own work (so would uvicorn's access log).
    configure_logging(config.log_level)
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                http=protocol(config.max_header_bytes),
                # h11's bound on a request's head (the httptools protocol counts its own).
                h11_max_incomplete_event_size=config.max_header_bytes)
