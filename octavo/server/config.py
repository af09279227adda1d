"""HTTP server settings (the engine's own settings live in octavo.config)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from octavo.server.limits import RequestLimits
from octavo.server.shedding import ShedConfig
from octavo.server.tool_parsers import PARSERS

DEFAULT_PUBLIC_ROUTES = ("/health", "/metrics")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Empty: no authentication. Else every route except ``public_routes``
    # needs "Authorization: Bearer <one of api_keys>".
    api_keys: tuple[str, ...] = ()
    public_routes: tuple[str, ...] = DEFAULT_PUBLIC_ROUTES
    # Requests admitted but not yet producing tokens beyond which new ones get 503.
    max_waiting_requests: Optional[int] = None
    shutdown_timeout_s: float = 30.0
    max_body_bytes: int = 8 * 1024 * 1024
    engine_start_timeout_s: float = 600.0
    log_level: str = "info"
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Near capacity, new low-priority requests get 503 (octavo/server/shedding.py).
    shedding: ShedConfig = field(default_factory=ShedConfig)
    # Jinja from the client runs in a sandbox with a deadline, but is still
    # code of the client's choosing: off unless the operator opts in.
    trust_request_chat_template: bool = False
    # Non-empty: /metrics needs one of these keys (and no other), whatever
    # public_routes and api_keys say.
    metrics_api_keys: tuple[str, ...] = ()
    # Engine supervision (octavo.engine.restart_policy): a dead engine is
    # restarted up to this many times within the window; one more death
    # there and the server exits non-zero. 0: exit at the first death.
    engine_max_restarts: int = 3
    engine_restart_window_s: float = 60.0
    # Seconds from arrival after which a request is aborted (504); None: no limit.
    request_timeout_s: Optional[float] = None
    # The chat template's text, replacing the model's own (--chat-template).
    chat_template: Optional[str] = None
    # tool_choice "auto": calls read from the model's text by this parser
    # (octavo.server.tool_parsers); both must be set, as in vLLM.
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    # Browser origins allowed to call the API (CORS); ("*",) for any. Empty: no CORS headers.
    allowed_origins: tuple[str, ...] = ()
    # The path prefix a reverse proxy serves the API under ("/api").
    root_path: str = ""
    # Both set: HTTPS.
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    # One log line per HTTP request (uvicorn's access log).
    access_log: bool = True

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("api_keys", "metrics_api_keys"):
            if any(not k or k != k.strip() for k in getattr(self, name)):
                raise ValueError(f"{name}: a key must not be empty or start or end with whitespace")
        if self.engine_max_restarts < 0:
            raise ValueError(f"engine_max_restarts must be >= 0, got {self.engine_max_restarts}")
        if self.engine_restart_window_s <= 0:
            raise ValueError(f"engine_restart_window_s must be > 0, got {self.engine_restart_window_s}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser)")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with / and not end with one, got {self.root_path!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: set both or neither")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file: {path}")
