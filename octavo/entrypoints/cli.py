"""The ``octavo`` command: ``octavo serve [MODEL]``, ``octavo gateway``, ``octavo autoscale`` and ``octavo generate [MODEL]``."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from typing import Optional, Sequence

import octavo
from octavo.autoscale.config import add_flags as add_autoscale_flags, load_config as load_autoscale_config
from octavo.entrypoints.engine_args import add_engine_args, engine_config_from_args, engine_options, parse_bytes
from octavo.log import configure_logging
from octavo.server.config import DEFAULT_PUBLIC_ROUTES, ServerConfig
from octavo.server.limits import RequestLimits
from octavo.server.shedding import ShedConfig
from octavo.server.tool_parsers import PARSERS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="Octavo LLM inference engine")
    parser.add_argument("--version", action="version", version=f"octavo {octavo.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None,
                       help="require this bearer key; repeat for several (default: $OCTAVO_API_KEY)")
    serve.add_argument(
        "--public-routes",
        default=",".join(DEFAULT_PUBLIC_ROUTES),
        help="comma-separated paths served without the API key (default: %(default)s)",
    )
    serve.add_argument("--max-waiting-requests", type=int, default=None, help="beyond this many pending: 503")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    serve.add_argument("--max-body-size", type=parse_bytes, default=8 * 2**20, help="larger bodies get 413")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--api-key-file", default=None,
                       help="file of bearer keys, one a line (# comments); keeps keys out of the process list")
    serve.add_argument("--metrics-api-key", action="append", default=None,
                       help="/metrics needs this key (repeatable) instead of being public or using --api-key")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, to use instead of the model's")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto": calls read from the model\'s text by --tool-call-parser')
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                       help="how the model writes tool calls (for --enable-auto-tool-choice)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept chat_template (and chat_template_kwargs.chat_template) from requests")
    for f in fields(ShedConfig):  # load shedding by priority: --shed-kv-usage, ...
        serve.add_argument(f"--{f.name.replace('_', '-')}", type=float if f.name == "shed_kv_usage" else int,
                           default=f.default, help=f.metadata["help"])
    for f in fields(RequestLimits):  # one option per request limit, named after its field
        serve.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                           help=f"{f.metadata['help']} (default: %(default)s)")
    # Defaults from ServerConfig itself, so there is one source for them.
    serve.add_argument("--engine-max-restarts", type=int, default=ServerConfig.engine_max_restarts,
                       help="restart a dead engine up to this many times per window, then exit 1 "
                            "(0: exit at once; default: %(default)s)")
    serve.add_argument("--engine-restart-window", type=float, default=ServerConfig.engine_restart_window_s,
                       help="seconds (default: %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=ServerConfig.request_timeout_s,
                       help="abort requests older than this many seconds (504); default: no limit")
    serve.add_argument("--allowed-origins", type=_origins, default=ServerConfig.allowed_origins,
                       help='browser origins allowed to call the API (CORS): a JSON list as vLLM takes it '
                            '(\'["*"]\') or comma-separated; default: none')
    serve.add_argument("--root-path", default=ServerConfig.root_path,
                       help="path prefix when served behind a reverse proxy (e.g. /api)")
    serve.add_argument("--ssl-keyfile", default=None, help="TLS private key file (with --ssl-certfile: HTTPS)")
    serve.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    serve.add_argument("--disable-log-requests", "--disable-uvicorn-access-log", dest="access_log",
                       action="store_false", help="no log line per HTTP request")

    _add_gateway_parser(sub)
    add_autoscale_flags(sub.add_parser("autoscale", help="scale `octavo serve` replicas (local processes or a "
                                                         "Kubernetes Deployment) on load; docs/AUTOSCALING.md"))

    gen = sub.add_parser("generate", help="generate offline (no server)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    # Unset sampling options take the model's generation_config.json values,
    # as the server does: tiny models loop under greedy decoding.
    gen.add_argument("--temperature", type=float, default=None, help="default: the model's, else 1.0")
    gen.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    gen.add_argument("--top-k", type=int, default=None, help="default: the model's, else off")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    return parser


def _add_gateway_parser(sub: argparse._SubParsersAction) -> None:
    from octavo.gateway.config import ROUTING_POLICIES

    gw = sub.add_parser("gateway", help="one OpenAI-compatible endpoint in front of several `octavo serve` replicas")
    gw.add_argument("--replica", action="append", default=None, metavar="URL", help="a replica; repeat for several")
    gw.add_argument("--config", default=None, help="YAML file of gateway settings (keys, limits, breaker, cache)")
    # Unset options (None) leave the config file's value or the default.
    gw.add_argument("--host", default=None)
    gw.add_argument("--port", type=int, default=None)
    gw.add_argument("--routing", choices=ROUTING_POLICIES, default=None)
    gw.add_argument("--tokenizer", default=None, help="the replicas' model folder (kv-aware routing tokenizes with it)")
    gw.add_argument("--kv-events", action="append", default=None, metavar="URL=ENDPOINT",
                    help="a replica's --kv-events-endpoint, e.g. http://10.0.0.5:8000=tcp://10.0.0.5:5557")
    gw.add_argument("--discovery-dns", default=None, help="a DNS name whose addresses are replicas")
    gw.add_argument("--discovery-port", type=int, default=None)
    gw.add_argument("--redis-url", default=None, help="share the response cache and rate limits through Redis")
    gw.add_argument("--admin-key", default=None, help="bearer key of the admin API (default: $OCTAVO_GATEWAY_ADMIN_KEY)")
    gw.add_argument("--upstream-api-key", default=None, help="bearer key sent to the replicas")
    gw.add_argument("--max-imbalance", type=int, default=None,
                    help="kv-aware/prefix/session give way to least-load beyond this many queued requests")
    gw.add_argument("--no-cache", action="store_true", help="turn the response cache off")
    gw.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])


def _gateway(args: argparse.Namespace) -> None:
    from octavo.gateway.config import load_config
    from octavo.gateway.launcher import run

    overrides = {
        name: getattr(args, name)
        for name in ("host", "port", "routing", "tokenizer", "discovery_dns", "discovery_port", "redis_url",
                     "admin_key", "upstream_api_key", "max_imbalance", "log_level")
        if getattr(args, name) is not None
    }
    if args.replica:
        overrides["replicas"] = args.replica
    if "admin_key" not in overrides and os.environ.get("OCTAVO_GATEWAY_ADMIN_KEY"):
        overrides["admin_key"] = os.environ["OCTAVO_GATEWAY_ADMIN_KEY"]
    if args.kv_events:
        pairs = [item.rpartition("=") for item in args.kv_events]
        if any(not url or not endpoint for url, _, endpoint in pairs):
            raise ValueError("--kv-events: expected URL=ENDPOINT")
        overrides["kv_events"] = {url: endpoint for url, _, endpoint in pairs}
    if args.no_cache:
        overrides["cache"] = {"enabled": False}
    config = load_config(args.config, overrides)
    if not config.replicas and not config.discovery_dns and not config.kv_events and not config.admin_key:
        raise ValueError("no replicas: give --replica, --discovery-dns, or an --admin-key to add them at run time")
    run(config)


def _serve(args: argparse.Namespace) -> None:
    from octavo.server.launcher import serve

    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        api_keys=_api_keys(args),
        public_routes=tuple(r.strip() for r in args.public_routes.split(",") if r.strip()),
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout_s=args.shutdown_timeout,
        max_body_bytes=args.max_body_size,
        log_level=args.log_level,
        limits=RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)}),
        shedding=ShedConfig(**{f.name: getattr(args, f.name) for f in fields(ShedConfig)}),
        trust_request_chat_template=args.trust_request_chat_template,
        metrics_api_keys=tuple(args.metrics_api_key or ()),
        engine_max_restarts=args.engine_max_restarts,
        engine_restart_window_s=args.engine_restart_window,
        request_timeout_s=args.request_timeout,
        chat_template=_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        allowed_origins=args.allowed_origins,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        access_log=args.access_log,
    )
    serve(engine_config_from_args(args), server_config)


def _chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: a file's text, or the template itself (vLLM's rule:
    text with no Jinja or newline in it must be a file)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template: no such file: {value}")
    return value


def _origins(text: str) -> tuple[str, ...]:
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


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key and --api-key-file together; $OCTAVO_API_KEY when neither is given."""
    keys = list(args.api_key or ())
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file) as f:
                lines = [line.strip() for line in f]
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {exc.strerror}") from None
        file_keys = [line for line in lines if line and not line.startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file: no keys in {args.api_key_file}")
        keys += file_keys
    if not keys and os.environ.get("OCTAVO_API_KEY"):
        keys.append(os.environ["OCTAVO_API_KEY"])
    return tuple(keys)


def _generate(args: argparse.Namespace) -> None:
    from octavo.entrypoints.llm import LLM
    from octavo.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_options(args))
    defaults = llm.engine.generation_defaults

    def pick(name: str, fallback: float) -> float:
        value = getattr(args, name)
        return value if value is not None else defaults.get(name, fallback)

    params = SamplingParams(
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=int(pick("top_k", 0)),
        max_tokens=args.max_tokens,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")


def _autoscale(args: argparse.Namespace) -> None:
    from octavo.autoscale.runner import run

    run(load_autoscale_config(args))


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "info"))
    try:
        if args.command == "serve":
            _serve(args)
        elif args.command == "gateway":
            _gateway(args)
        elif args.command == "autoscale":
            _autoscale(args)
        else:
            _generate(args)
    except ValueError as exc:  # bad configuration: a message, not a traceback
        print(f"octavo: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
