"""Every command's options come from its config dataclasses through one helper (octavo/entrypoints/options.py),
and every command reads a --config file through one reader (octavo/entrypoints/config_file.py)."""
from __future__ import annotations

import argparse
import re

import pytest

from octavo.entrypoints.cli import build_parser, gateway_config, parse_command, server_config_from_args
from octavo.entrypoints.engine_args import engine_config_from_args
from octavo.entrypoints.options import Option, show_default


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every runnable (sub)command's parser, by its name ("simulate run")."""
    found = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not sub:
            found[name] = parser
        for action in sub:
            for choice, child in action.choices.items():
                walk(child, f"{name} {choice}".strip())

    walk(build_parser(), "")
    return found


COMMANDS = _commands()


def test_every_command_is_found():
    assert {"serve", "generate", "run-batch", "gateway", "autoscale", "download", "simulate run",
            "simulate calibrate"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_lists_every_field_with_its_default(name):
    parser = COMMANDS[name]
    assert parser.options, f"`octavo {name}` takes no config dataclass"
    text = " ".join(parser.format_help().split())
    for option in parser.options:
        if not option.on_command_line or (option.name == "model" and option.section == "model"):
            continue
        assert option.flag in text, f"{name}: {option.flag}"
        help_text = _help_of(parser, option)
        assert "default" in help_text.lower(), f"{name} {option.flag}: {help_text!r}"
        if "default" not in option.meta.get("help", "").lower():  # the help does not state it in words
            shown = "no default" if option.required else f"default: {show_default(option.default)}"
            assert shown in help_text, f"{name} {option.flag}: {help_text!r}"


def _help_of(parser: argparse.ArgumentParser, option: Option) -> str:
    action = next(a for a in parser._actions if option.flag in a.option_strings)
    return parser._get_formatter()._expand_help(action)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_no_flag_is_declared_twice(name):
    parser = COMMANDS[name]
    flags = [s for a in parser._actions for s in a.option_strings]
    assert len(flags) == len(set(flags)), sorted({f for f in flags if flags.count(f) > 1})
    dests = [o.dest for o in parser.options]
    assert len(dests) == len(set(dests)), sorted({d for d in dests if dests.count(d) > 1})


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_flags_are_the_field_names(name):
    for option in COMMANDS[name].options:
        assert option.flag == "--" + option.dest.replace(".", "-").replace("_", "-")
        assert re.fullmatch(r"--[a-z0-9-]+", option.flag), option.flag


@pytest.mark.parametrize("old, new, value", [
    (["--max-body-size", "1MiB"], ["--max-body-bytes", "1MiB"], ("max_body_bytes", 2**20)),
    (["--shutdown-timeout", "5"], ["--shutdown-timeout-s", "5"], ("shutdown_timeout_s", 5.0)),
    (["--request-timeout", "9"], ["--request-timeout-s", "9"], ("request_timeout_s", 9.0)),
    (["--engine-restart-window", "7"], ["--engine-restart-window-s", "7"], ("engine_restart_window_s", 7.0)),
    (["--api-key", "k1", "--api-key", "k2"], ["--api-keys", "k1", "--api-keys", "k2"], ("api_keys", ("k1", "k2"))),
    (["--metrics-api-key", "m"], ["--metrics-api-keys", "m"], ("metrics_api_keys", ("m",))),
    (["--disable-log-requests"], ["--no-access-log"], ("access_log", False)),
    (["--disable-uvicorn-access-log"], ["--no-access-log"], ("access_log", False)),
])
def test_an_old_spelling_still_works(tmp_path, old, new, value):
    configs = [server_config_from_args(build_parser().parse_args(["serve", str(tmp_path), *argv]))
               for argv in (old, new)]
    name, expected = value
    assert getattr(configs[0], name) == getattr(configs[1], name) == expected


def test_old_gateway_spellings_still_work():
    args = build_parser().parse_args(["gateway", "--replica", "http://a:1", "--replica", "http://b:2", "--no-cache",
                                      "--kv-events", "http://a:1=tcp://a:5557"])
    config = gateway_config(args)
    assert config.replicas == ["http://a:1", "http://b:2"] and config.cache.enabled is False
    assert config.kv_events == {"http://a:1": "tcp://a:5557"}


def test_serve_takes_a_file_and_flags_together(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max_num_seqs: 8\nport: 9001\nshutdown_timeout: 3\nmax_body_bytes: 2MiB\nmax_n: 4\n"
                    "allowed_origins: [https://a.example]\n")
    args, _ = parse_command(build_parser(), ["serve", str(tmp_path), "--config", str(path), "--port", "9002",
                                             "--max-n", "5"])
    engine, server = engine_config_from_args(args), server_config_from_args(args)
    assert engine.scheduler.max_num_seqs == 8  # from the file
    assert server.port == 9002 and server.limits.max_n == 5  # the flags win
    assert server.shutdown_timeout_s == 3.0 and server.max_body_bytes == 2 * 2**20
    assert server.allowed_origins == ("https://a.example",)


def test_gateway_takes_a_file_and_flags_together(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("replicas: [http://a:1]\nport: 9100\nrouting: session\ncache: {enabled: false, ttl_s: 5}\n"
                    "breaker_cooldown_s: 2\nkv_events: {http://a:1: tcp://a:5557}\n")
    args, _ = parse_command(build_parser(), ["gateway", "--config", str(path), "--replica", "http://b:2",
                                             "--routing", "least-load", "--cache-max-entries", "7"])
    config = gateway_config(args)
    assert config.replicas == ["http://a:1", "http://b:2"]  # the command line adds to the file's replicas
    assert config.routing == "least-load" and config.port == 9100
    assert config.cache.enabled is False and config.cache.ttl_s == 5 and config.cache.max_entries == 7
    assert config.breaker.cooldown_s == 2 and config.kv_events == {"http://a:1": "tcp://a:5557"}


@pytest.mark.parametrize("command", ["gateway", "autoscale", "simulate run", "download"])
def test_every_command_says_did_you_mean_for_a_file_typo(tmp_path, command):
    path = tmp_path / "c.yaml"
    path.write_text("log_levl: debug\n" if command in ("gateway", "autoscale") else "cache_dri: x\n"
                    if command == "download" else "durration: 5\n")
    with pytest.raises(ValueError, match=r"unknown option '\w+' \(did you mean '\w+'\?\)"):
        parse_command(build_parser(), [*command.split(), "--config", str(path)])
