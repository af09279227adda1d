"""Runs the gateway's app under uvicorn until SIGINT/SIGTERM."""
from __future__ import annotations

import logging

import uvicorn

from octavo.gateway.app import build_app
from octavo.gateway.config import GatewayConfig


def run(config: GatewayConfig) -> None:
    logging.getLogger().setLevel(config.log_level.upper())
    # httpx logs every upstream request at INFO: a line per request costs more
    # than the gateway's own work (so does uvicorn's access log).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=config.log_level, access_log=False)
