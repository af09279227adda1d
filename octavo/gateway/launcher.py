"""Runs the gateway's app under uvicorn until SIGINT/SIGTERM."""
from __future__ import annotations

import uvicorn

from octavo.gateway.app import build_app
from octavo.gateway.config import GatewayConfig


def run(config: GatewayConfig) -> None:
    # No access log: one line per request costs more than the gateway's own work.
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=config.log_level, access_log=False)
