"""``--config FILE``: a command's options from a YAML file, for every command.

The keys are the command's option names (``max-num-seqs`` or ``max_num_seqs``, an alias such as
``kv-cache-memory``, a switch's negation such as ``no_prefix_caching``; ``model`` for the positional MODEL), or
a section's name holding a mapping of its fields (``breaker: {failure_threshold: 5}``, ``policy: {reactive:
{...}}``), as the config dataclasses nest. Each value goes through the same parser as the flag (``2GiB``, ``4k``,
the choices). Flags given on the command line win over the file (a list option given on the command line
replaces the file's list, unless its field says the command line adds to it); the config dataclasses validate the
result as they validate flags.
"""
from __future__ import annotations

import argparse
import difflib
from pathlib import Path
from typing import Any, Iterable, Optional

from octavo.entrypoints.options import Option


def read_config_file(path: str, options: Iterable[Option]) -> dict[str, Any]:
    """The file's values by option dest. ``ValueError`` naming the file and the key for anything wrong."""
    return _Reader(path, list(options)).read(_load(path), ())


def merge_config_file(args: argparse.Namespace, path: str, options: Iterable[Option]) -> None:
    """Fill ``args`` with the file's values for the options the command line left out."""
    by_dest = {o.dest: o for o in options}
    for dest, value in read_config_file(path, by_dest.values()).items():
        option = by_dest[dest]
        if not hasattr(args, dest):
            setattr(args, dest, value)
        elif option.meta.get("add_to_file"):
            setattr(args, dest, list(value) + list(getattr(args, dest)))


class _Reader:
    def __init__(self, path: str, options: list[Option]) -> None:
        self.path = path
        self.options = options
        # Top level: every spelling of every option, without dashes ('max-num-seqs', 'no-prefix-caching').
        self.names: dict[str, tuple[Option, bool]] = {}
        for option in options:
            if not option.on_command_line:
                self.names[option.dest.replace("_", "-")] = (option, False)
                continue
            for flag in option.flags:
                self.names[flag.lstrip("-")] = (option, False)
            for flag in option.negative_flags:
                self.names[flag.lstrip("-")] = (option, True)

    def read(self, values: dict, section: tuple[str, ...]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in values.items():
            key = str(key)
            path = section + (key,)
            dotted = ".".join(path)
            if isinstance(value, dict) and self._is_section(path):
                result.update(self.read(value, path))
                continue
            found = self._find(key, section)
            if found is None:
                raise ValueError(f"{self.path}: unknown option {dotted!r}{self._suggest(key, section)}")
            option, negated = found
            result[option.dest] = _convert(f"{self.path}: {dotted}", option, value, negated)
        return result

    def _is_section(self, path: tuple[str, ...]) -> bool:
        return any(len(o.path) > len(path) and o.path[: len(path)] == path for o in self.options)

    def _find(self, key: str, section: tuple[str, ...]) -> Optional[tuple[Option, bool]]:
        if not section:
            return self.names.get(key.replace("_", "-"))
        return next(((o, False) for o in self.options if o.path == section + (key,)), None)

    def _suggest(self, key: str, section: tuple[str, ...]) -> str:
        if section:
            known = [o.path[len(section)] for o in self.options if o.path[: len(section)] == section]
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            return f" (did you mean {close[0]!r}?)" if close else ""
        close = difflib.get_close_matches(key.replace("_", "-"), list(self.names), n=1, cutoff=0.6)
        if not close:
            return ""
        name = close[0].replace("-", "_") if "_" in key else close[0]
        return f" (did you mean {name!r}?)"


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


def _convert(where: str, option: Option, value: Any, negated: bool) -> Any:
    if option.type is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value != negated
    if not option.on_command_line:  # structured values no flag spells (the gateway's keys): the dataclass checks
        return value
    if "parse" in option.meta and isinstance(value, list):  # the list itself, not one string to split
        return [str(item) for item in value]
    if option.is_list:
        if isinstance(value, dict):  # a mapping option written as a mapping
            value = [f"{k}={v}" for k, v in value.items()]
        items = value if isinstance(value, list) else [value]
        if not items and not option.meta.get("repeatable"):
            raise ValueError(f"{where}: expected at least one value")
        return [_scalar(where, option, item) for item in items]
    return _scalar(where, option, value)


def _scalar(where: str, option: Option, value: Any) -> Any:
    # Leaving a key out keeps the default; null would bypass the option's type.
    if value is None or isinstance(value, (bool, dict, list)):
        raise ValueError(f"{where}: expected a single value, got {value!r}")
    parse = option.parser()
    try:
        converted = parse(str(value))
    except argparse.ArgumentTypeError as exc:  # the option's own parser says what it takes
        raise ValueError(f"{where}: {exc}") from None
    except (ValueError, TypeError):
        raise ValueError(f"{where}: expected {getattr(parse, '__name__', 'a valid value')}, got {value!r}") from None
    if option.choices is not None and converted not in option.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, option.choices))}")
    return converted
