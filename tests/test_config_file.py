"""`--config FILE` (YAML) for every command, and `--help` showing every default."""
from __future__ import annotations

import argparse

import pytest

from octavo.entrypoints.cli import build_parser, main, parse_command, server_config_from_args, subparser
from octavo.entrypoints.engine_args import engine_config_from_args

_CONFIG_COMMANDS = ("serve", "generate", "run-batch")


def _parse(tmp_path, yaml_text: str, *argv: str) -> argparse.Namespace:
    """What main() does before running the command."""
    (tmp_path / "c.yaml").write_text(yaml_text)
    argv_list = [argv[0], str(tmp_path), "--config", str(tmp_path / "c.yaml"), *argv[1:]]
    return parse_command(build_parser(), argv_list)[0]


SERVE_YAML = """
max_num_seqs: 8                 # underscores
kv-cache-memory: 64MiB          # dashes, an alias, a size
max-model-len: 4k               # a count as vLLM writes it
no_prefix_caching: true         # the negative switch
speculative_adaptive: false     # a switch turned off
api_key: [key-a, key-b]         # a repeatable option
served_model_name: [one, two]   # several values
disable_log_requests: true      # a store_false option
max_n: 4                        # a request limit
request_timeout: 2.5
"""


def test_values_are_typed_as_the_flags_are(tmp_path):
    args = _parse(tmp_path, SERVE_YAML, "serve")
    engine = engine_config_from_args(args)
    assert engine.scheduler.max_num_seqs == 8
    assert engine.cache.kv_cache_memory_bytes == 64 * 2**20
    assert engine.model.max_model_len == 4000
    assert engine.cache.enable_prefix_caching is False and engine.speculative.speculative_adaptive is False
    assert engine.model.served_model_name == ("one", "two")
    server = server_config_from_args(args)
    assert server.limits.max_n == 4 and server.request_timeout_s == 2.5 and server.access_log is False
    assert server.api_keys == ("key-a", "key-b")


def test_command_line_flags_override_the_file(tmp_path):
    args = _parse(tmp_path, SERVE_YAML, "serve", "--max-num-seqs", "3", "--prefix-caching", "--api-key", "key-c")
    engine = engine_config_from_args(args)
    assert engine.scheduler.max_num_seqs == 3 and engine.cache.enable_prefix_caching is True
    assert server_config_from_args(args).api_keys == ("key-c",)  # replaced, not appended to
    assert engine.cache.kv_cache_memory_bytes == 64 * 2**20  # the rest still from the file


def test_generate_and_run_batch_take_a_file_too(tmp_path):
    args = _parse(tmp_path, "prompt: [a, b]\nmax_tokens: 3\ntemperature: 0\n", "generate")
    assert list(args.prompt) == ["a", "b"] and args.max_tokens == 3 and args.temperature == 0.0
    args = _parse(tmp_path, "input_file: in.jsonl\noutput-file: out.jsonl\nblock_size: 32\n", "run-batch")
    assert (args.input_file, args.output_file) == ("in.jsonl", "out.jsonl")
    assert engine_config_from_args(args).cache.block_size == 32


@pytest.mark.parametrize("yaml_text, message", [
    ("max_num_seq: 3\n", "unknown option 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ("kv-cache-memry: 1GiB\n", "unknown option 'kv-cache-memry' (did you mean 'kv-cache-memory'?)"),
    ("max_num_seqs: lots\n", "max_num_seqs: expected int, got 'lots'"),
    ("max_num_seqs: 2.5\n", "max_num_seqs: expected int, got 2.5"),
    ("kv_cache_memory: lots\n", "kv_cache_memory: not a size"),
    ("dtype: float64\n", "dtype: 'float64' is not one of auto"),
    ("fused_ops: maybe\n", "fused_ops: expected true or false"),
    ("port: null\n", "port: expected a single value"),
    ("max_num_seqs: 0\n", "max_num_seqs must be >= 1"),  # the dataclass's own check
    ("- a list\n", "expected a mapping of option names to values"),
    ("max_num_seqs: [\n", "not valid YAML"),
])
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, capsys, yaml_text, message):
    (tmp_path / "c.yaml").write_text(yaml_text)
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path), "--config", str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_missing_file_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path), "--config", str(tmp_path / "nope.yaml")])
    assert "--config: cannot read" in capsys.readouterr().err


def test_a_required_option_may_come_from_the_file_only(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["generate", str(tmp_path)])
    assert "required: --prompt" in capsys.readouterr().err
    assert list(_parse(tmp_path, "prompt: hi\n", "generate").prompt) == ["hi"]


@pytest.mark.parametrize("command", _CONFIG_COMMANDS)
def test_help_shows_every_default(command):
    parser = subparser(build_parser(), command)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action)
        assert "default" in text.lower(), f"{command} {action.option_strings or action.dest}: {text!r}"
    # --max-tokens names its fallback, not only the model's generation_config.
    help_text = " ".join(parser.format_help().split())
    assert "max_new_tokens, else 64" in help_text or command != "generate"
