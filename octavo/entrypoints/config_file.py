"""``--config serve.yaml``: a command's options from a YAML file.

The keys are the command's option names (``max-num-seqs`` or
``max_num_seqs``; ``model`` for the positional MODEL). Each value goes
through the same parser as the command-line flag (``2GiB``, ``4k``, the
choices), then becomes that option's default, so a flag given on the command
line wins over the file; the config dataclasses validate the result as they
validate flags. Repeatable options (``api-key``, ``prompt``) take a list; on
the command line they replace the file's list instead of adding to it.
"""
from __future__ import annotations

import argparse
import difflib
from pathlib import Path
from typing import Any, Optional, Sequence

_BOOL_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def config_path(argv: Sequence[str], commands: Sequence[str]) -> Optional[tuple[str, str]]:
    """(command, path) when ``argv`` runs one of ``commands`` with ``--config PATH``."""
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command is None or argv[command] not in commands:
        return None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv[command + 1 :])
    return (argv[command], known.config) if known.config is not None else None


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, list]:
    """Set ``parser``'s defaults from the YAML file at ``path``. Returns the
    repeatable options' lists, which ``fill_lists`` applies after parsing
    (argparse would append the command line's values to a list default).
    ``ValueError`` naming the file and the key for anything wrong."""
    values = _load(path)
    by_name = _options(parser)
    defaults: dict[str, Any] = {}
    lists: dict[str, list] = {}
    for key, value in values.items():
        action = by_name.get(str(key).replace("_", "-"))
        if action is None:
            raise ValueError(f"{path}: unknown option {key!r}{_suggest(str(key), by_name)}")
        converted = _convert(path, str(key), action, value)
        action.required = False  # given by the file
        if isinstance(action, argparse._AppendAction):
            lists[action.dest] = converted
        else:
            defaults[action.dest] = converted
    parser.set_defaults(**defaults)
    return lists


def fill_lists(parser: argparse.ArgumentParser, args: argparse.Namespace, lists: dict[str, list]) -> None:
    """The file's list for each repeatable option the command line left out."""
    for action in parser._actions:
        if action.dest in lists and getattr(args, action.dest) == action.default:
            setattr(args, action.dest, lists[action.dest])


def _load(path: str) -> dict:
    import yaml  # only when a config file is used: pyyaml is not needed otherwise

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--config: cannot read {path}: {exc.strerror}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values, got {type(values).__name__}")
    return values


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Option name without dashes ('max-num-seqs', 'no-prefix-caching', 'model') -> its action."""
    result: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.dest == "config":
            continue
        names = [s for s in action.option_strings if s.startswith("--")] or [action.dest]
        for name in names:
            result[name.lstrip("-")] = action
    return result


def _suggest(key: str, by_name: dict[str, argparse.Action]) -> str:
    close = difflib.get_close_matches(key.replace("_", "-"), list(by_name), n=1, cutoff=0.6)
    if not close:
        return ""
    name = close[0].replace("-", "_") if "_" in key else close[0]
    return f" (did you mean {name!r}?)"


def _convert(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"{path}: {key}"
    if isinstance(action, _BOOL_ACTIONS):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        negated = key.replace("_", "-").startswith("no-") and f"--{key.replace('_', '-')}" in action.option_strings
        return value != (negated or isinstance(action, argparse._StoreFalseAction))
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        if not items and action.nargs == "+":
            raise ValueError(f"{where}: expected at least one value")
        return [_scalar(where, action, item) for item in items]
    return _scalar(where, action, value)


def _scalar(where: str, action: argparse.Action, value: Any) -> Any:
    # Leaving a key out keeps the default; null would bypass the option's type.
    if value is None or isinstance(value, (bool, dict, list)):
        raise ValueError(f"{where}: expected a single value, got {value!r}")
    text = str(value)
    try:
        converted = action.type(text) if action.type is not None else text
    except argparse.ArgumentTypeError as exc:  # the option's own parser says what it takes
        raise ValueError(f"{where}: {exc}") from None
    except (ValueError, TypeError):
        raise ValueError(f"{where}: expected {getattr(action.type, '__name__', 'a valid value')}, got {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return converted
