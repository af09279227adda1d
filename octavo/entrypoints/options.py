"""Command-line options generated from config dataclasses: the one way every ``octavo`` command gets its options.

A field becomes ``--field-name`` with the field's type, default and help (``metadata["help"]``, see
``octavo.config.option``). Nested config dataclasses are sections: their fields are options of the command too,
under their own names, or as ``--section-field`` when the section is declared with ``section(..., prefixed=True)``.
Field metadata may add ``aliases`` (older spellings that keep working), ``negations`` (flags that turn a switch
off), ``choices``, ``unit`` ("bytes": 2GiB, "tokens": 4k / 4K; others only documented), ``parse`` (one string to
the field's value: ``--public-routes /a,/b``), ``repeatable`` (a list option given once per value rather than as
several values after one flag), ``metavar``, ``add_to_file`` (the command line adds to the config file's list
instead of replacing it) and ``cli=False`` (config file only: values no flag can spell).

Options left off the command line stay out of the namespace (argparse.SUPPRESS): a config file fills them, then
the dataclass defaults. Torch-free, as the gateway and the autoscaler run without torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import re
import typing
from decimal import Decimal
from typing import Any, Callable, Iterable, Mapping, Optional

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT])?\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_POWER = {"K": 1, "M": 2, "G": 3, "T": 4}


def parse_count(text: str) -> int:
    """Token counts as vLLM writes them: '4k' -> 4000, '4K' -> 4096, '1.5m' -> 1500000, '2048' -> 2048."""
    match = _COUNT.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (examples: 2048, 4k, 4K, 1m)")
    number, unit = Decimal(match.group(1)), match.group(2) or ""
    value = number * (2 ** (10 * _BINARY_POWER[unit]) if unit.isupper() else _COUNT_UNITS[unit])
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a whole count: {text!r}")
    return int(value)


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512M' -> 512000000, '1000' -> 1000."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1G, 1000000)")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


UNIT_PARSERS: dict[str, Callable[[str], int]] = {"bytes": parse_bytes, "tokens": parse_count}


@dataclasses.dataclass(frozen=True)
class Option:
    """One leaf field of a config dataclass tree, as a command-line option."""

    path: tuple[str, ...]  # field names from the root dataclass: ("policy", "reactive", "targets")
    dest: str  # the namespace attribute: the path less its unprefixed sections, dotted ("reactive.targets")
    field: dataclasses.Field
    type: Any  # the field's type, Optional removed

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def section(self) -> str:
        """The first section the field is in ("" for a field of the root)."""
        return self.path[0] if len(self.path) > 1 else ""

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace(".", "-").replace("_", "-")

    @property
    def flags(self) -> list[str]:
        """The flag and its aliases: the spellings that set the value."""
        return [self.flag, *self.meta.get("aliases", ())]

    @property
    def negative_flags(self) -> list[str]:
        """A switch's spellings that turn it off: --no-<each flag>, and the declared negations."""
        if self.type is not bool:
            return []
        return [f"--no-{f[2:]}" for f in self.flags] + list(self.meta.get("negations", ()))

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            return self.field.default_factory()  # type: ignore[misc]
        return self.field.default

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def on_command_line(self) -> bool:
        return self.meta.get("cli", True)

    @property
    def choices(self) -> Optional[tuple]:
        if typing.get_origin(self.type) is typing.Literal:
            return typing.get_args(self.type)
        if isinstance(self.type, type) and issubclass(self.type, enum.Enum):
            return tuple(m.value for m in self.type)
        return self.meta.get("choices")

    def parser(self) -> Callable[[str], Any]:
        """Text (one command-line word, one YAML scalar) to one value: the field's, or one item of a list field."""
        if "parse" in self.meta:
            return self.meta["parse"]
        if "unit" in self.meta and self.meta["unit"] in UNIT_PARSERS:
            return UNIT_PARSERS[self.meta["unit"]]
        origin = typing.get_origin(self.type)
        if origin is dict:
            return _pair(typing.get_args(self.type)[1])
        if origin in (tuple, list):
            return typing.get_args(self.type)[0]
        if origin is typing.Literal:
            return type(typing.get_args(self.type)[0])
        if isinstance(self.type, type) and issubclass(self.type, enum.Enum):
            return type(next(iter(self.type)).value)
        return self.type

    @property
    def is_list(self) -> bool:
        """Several values, unless ``parse`` reads the whole list from one string."""
        return typing.get_origin(self.type) in (tuple, list, dict) and "parse" not in self.meta


def _pair(value_type: Callable[[str], Any]) -> Callable[[str], tuple[str, Any]]:
    """KEY=VALUE, one entry of a mapping option."""

    def parse(text: str) -> tuple[str, Any]:
        key, sep, value = text.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            return key.strip(), value_type(value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not KEY=VALUE: {text!r}") from None

    parse.__name__ = "KEY=VALUE"
    return parse


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def dataclass_options(cls: type, only: Optional[Iterable[str]] = None) -> list[Option]:
    """Every leaf field of ``cls`` and its sections, in declaration order; ``only``: just these dests."""
    keep = None if only is None else set(only)
    result = [o for o in _walk(cls, (), ()) if keep is None or o.dest in keep]
    if keep is not None and len(result) != len(keep):
        raise KeyError(f"not options of {cls.__name__}: {sorted(keep - {o.dest for o in result})}")
    return result


def _walk(cls: type, path: tuple[str, ...], prefix: tuple[str, ...]) -> Iterable[Option]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = _base_type(hints[f.name])
        if dataclasses.is_dataclass(hint):
            yield from _walk(hint, path + (f.name,), prefix + ((f.name,) if f.metadata.get("prefixed") else ()))
        else:
            yield Option(path + (f.name,), ".".join(prefix + (f.name,)), f, hint)


def help_text(option: Option) -> str:
    """The field's help with its default, unless the help states the default itself."""
    text = option.meta.get("help", "")
    if "default" in text.lower():
        return text
    return f"{text} ({'no default' if option.required else f'default: {show_default(option.default)}'})"


def show_default(value: Any) -> str:
    if value is None or value == () or value == [] or value == {}:
        return "none"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """One argparse option per field (none for config-file-only fields), under the heading of its ``group``."""
    for option in options:
        if not option.on_command_line:
            continue
        target = _group(parser, option.meta["group"]) if "group" in option.meta else parser
        kwargs: dict[str, Any] = {"dest": option.dest, "default": argparse.SUPPRESS,
                                  "help": help_text(option).replace("%", "%%")}  # argparse formats help with %
        if option.type is bool:
            target.add_argument(*option.flags, action=argparse.BooleanOptionalAction, **kwargs)
            for negation in option.meta.get("negations", ()):
                target.add_argument(negation, action="store_false", dest=option.dest, default=argparse.SUPPRESS,
                                    help=f"the same as --no-{option.flag[2:]} (default: not given)")
            continue
        kwargs["type"] = option.parser()
        kwargs["metavar"] = option.meta.get("metavar") or (None if option.choices else option.name.upper())
        kwargs["choices"] = option.choices
        if option.is_list:
            if option.meta.get("repeatable"):
                kwargs["action"] = "append"
            else:
                kwargs["nargs"] = "+"
        target.add_argument(*option.flags, **kwargs)


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    found = next((g for g in parser._action_groups if g.title == title), None)
    return found or parser.add_argument_group(title)


def build(cls: type, values: Mapping[str, Any], options: Optional[Iterable[Option]] = None) -> Any:
    """An instance of ``cls`` from ``values`` by dest (those left out take the dataclass defaults)."""
    tree: dict[str, Any] = {}
    for option in dataclass_options(cls) if options is None else options:
        if option.dest in values:
            node = tree
            for part in option.path[:-1]:
                node = node.setdefault(part, {})
            node[option.name] = _as_field_type(option.type, values[option.dest])
    return _construct(cls, tree)


def _construct(cls: type, tree: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {name: _construct(_base_type(hints[name]), value) if isinstance(value, dict)
              and dataclasses.is_dataclass(_base_type(hints[name])) else value for name, value in tree.items()}
    return cls(**kwargs)


def _as_field_type(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is dict and isinstance(value, (list, tuple)):  # KEY=VALUE pairs
        return dict(value)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        return origin(value)
    return value


def given(args: argparse.Namespace, options: Iterable[Option]) -> dict[str, Any]:
    """The values of ``options`` the command line (or a config file) set, by dest."""
    return {o.dest: getattr(args, o.dest) for o in options if hasattr(args, o.dest)}
