"""HTTP server settings (the engine's own settings live in octavo.config)."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Optional

from octavo.config import option, section

from octavo.server.limits import RequestLimits
from octavo.server.shedding import ShedConfig
from octavo.server.tool_parsers import PARSERS

DEFAULT_PUBLIC_ROUTES = ("/health", "/metrics")
LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_routes(text: str) -> tuple[str, ...]:
    """'/health,/metrics' -> ('/health', '/metrics')."""
    return tuple(r.strip() for r in text.split(",") if r.strip())


def parse_origins(text: str) -> tuple[str, ...]:
    """'["https://a.example", "*"]' (vLLM's JSON) or 'https://a.example,https://b.example'."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return tuple(value)
    return tuple(o.strip() for o in text.split(",") if o.strip())


@dataclass
class ServerConfig:
    """``octavo serve``'s options besides the engine's (``run-batch`` takes the request-handling ones)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    # Empty: no authentication. Else every route except ``public_routes``
    # needs "Authorization: Bearer <one of api_keys>".
    api_keys: tuple[str, ...] = option(
        (), "require this bearer key; repeat for several (default: $OCTAVO_API_KEY, else none)",
        aliases=("--api-key",), repeatable=True, metavar="KEY")
    # Keys in a file stay out of the process list; the command line adds them to api_keys.
    api_key_file: Optional[str] = option(None, "file of bearer keys, one a line (# comments); keeps keys out of "
                                               "the process list")
    public_routes: tuple[str, ...] = option(DEFAULT_PUBLIC_ROUTES, "comma-separated paths served without the API "
                                            "key", parse=parse_routes, metavar="PATHS")
    # The server admits --max-num-seqs plus this many requests at once; the next gets 503 (octavo/server/admission.py).
    max_waiting_requests: Optional[int] = option(
        None, "requests that may wait beyond a full running batch (--max-num-seqs); more get 503 (default: no "
              "limit)")
    shutdown_timeout_s: float = option(30.0, "seconds to drain on SIGTERM", unit="seconds",
                                       aliases=("--shutdown-timeout",))
    max_body_bytes: int = option(8 * 1024 * 1024, "larger bodies get 413", unit="bytes", aliases=("--max-body-size",))
    engine_start_timeout_s: float = option(600.0, "seconds the engine may take to start", unit="seconds")
    log_level: str = option("info", "log level", choices=LOG_LEVELS)
    limits: RequestLimits = section(RequestLimits)
    # Near capacity, new low-priority requests get 503 (octavo/server/shedding.py).
    shedding: ShedConfig = section(ShedConfig)
    # Unknown body fields are dropped, logged and named in x-octavo-ignored-fields; strict: a 400 naming them.
    strict_request_fields: bool = option(False, "refuse requests with unknown fields (400) instead of ignoring them")
    # Jinja from the client runs in a sandbox with a deadline, but is still
    # code of the client's choosing: off unless the operator opts in.
    trust_request_chat_template: bool = option(
        False, "accept chat_template (and chat_template_kwargs.chat_template) from requests")
    # Non-empty: /metrics needs one of these keys (and no other), whatever
    # public_routes and api_keys say.
    metrics_api_keys: tuple[str, ...] = option(
        (), "/metrics needs this key (repeatable) instead of being public or using --api-key",
        aliases=("--metrics-api-key",), repeatable=True, metavar="KEY")
    moe_expert_metrics: bool = option(
        False, "/metrics: tokens routed to each expert of each mixture-of-experts layer "
        "(octavo:moe_expert_tokens_total, one series per layer and expert)")
    # Engine supervision (octavo.engine.restart_policy): a dead engine is
    # restarted up to this many times within the window; one more death
    # there and the server exits non-zero. 0: exit at the first death.
    engine_max_restarts: int = option(
        3, "restart a dead engine up to this many times per window, then exit 1 (0: exit at once)")
    engine_restart_window_s: float = option(60.0, "the window of --engine-max-restarts", unit="seconds",
                                            aliases=("--engine-restart-window",))
    # A step running longer is a hung engine: restarted as for a death (octavo/engine/step_clock.py).
    # Generous: a long prefill on a CPU takes seconds, a first step that compiles kernels a minute or two.
    engine_step_timeout_s: float = option(
        600.0, "a step running longer hangs the engine, which is restarted as for a death", unit="seconds",
        aliases=("--engine-step-timeout",))
    # Seconds from arrival after which a request is aborted (504); None: no limit.
    request_timeout_s: Optional[float] = option(
        None, "abort requests older than this many seconds, 504 (default: no limit)", unit="seconds",
        aliases=("--request-timeout",))
    # The chat template's text, replacing the model's own; the command line also takes a file holding it.
    chat_template: Optional[str] = option(
        None, "a Jinja chat template, or a file holding one, to use instead of the model's (default: the model's)")
    # tool_choice "auto": calls read from the model's text by this parser
    # (octavo.server.tool_parsers); both must be set, as in vLLM.
    enable_auto_tool_choice: bool = option(
        False, 'serve tool_choice "auto": calls read from the model\'s text by --tool-call-parser')
    tool_call_parser: Optional[str] = option(
        None, "how the model writes tool calls, for --enable-auto-tool-choice", choices=tuple(sorted(PARSERS)))
    # Browser origins allowed to call the API (CORS); ("*",) for any. Empty: no CORS headers.
    allowed_origins: tuple[str, ...] = option(
        (), 'browser origins allowed to call the API (CORS): a JSON list as vLLM takes it (\'["*"]\') or '
            'comma-separated', parse=parse_origins, metavar="ORIGINS")
    # The path prefix a reverse proxy serves the API under ("/api").
    root_path: str = option("", "path prefix when served behind a reverse proxy, e.g. /api (default: none)")
    # Both set: HTTPS.
    ssl_keyfile: Optional[str] = option(None, "TLS private key file (with --ssl-certfile: HTTPS; default: plain "
                                              "HTTP)")
    ssl_certfile: Optional[str] = option(None, "TLS certificate file")
    # One log line per HTTP request (uvicorn's access log).
    access_log: bool = option(True, "one log line per HTTP request",
                              negations=("--disable-log-requests", "--disable-uvicorn-access-log"))

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
        if self.engine_step_timeout_s <= 0:
            raise ValueError(f"engine_step_timeout_s must be > 0, got {self.engine_step_timeout_s}")
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
