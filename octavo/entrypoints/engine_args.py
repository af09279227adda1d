"""One path from user options to an EngineConfig.

The command line (``octavo serve``, ``octavo generate``) and ``LLM(model,
**kwargs)`` take the same names: the fields of EngineConfig's sections
(``ModelConfig``, ``CacheConfig``, ...), ``--field-name`` on the command line.
Options are generated from the dataclasses, so a new config field is
reachable from both at once, with its default and help from one place.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import typing
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

from octavo.assets import MINI_DRAFT_MODEL_PATH, MINI_MODEL_PATH
from octavo.assets.default_model import SMOLLM2, default_model
from octavo.config import EngineConfig
from octavo.entrypoints.hub import looks_like_hub_id, resolve_hub_model

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT])?\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_POWER = {"K": 1, "M": 2, "G": 3, "T": 4}


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """One engine option: the section of EngineConfig it lives in and its field."""

    section: str  # the EngineConfig attribute: "model", "cache", ...
    field: dataclasses.Field
    type: type  # int for Optional[int], and so on

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def config_fields() -> list[ConfigField]:
    """Every field of every section of EngineConfig, in declaration order."""
    result = []
    sections = typing.get_type_hints(EngineConfig)
    for section in dataclasses.fields(EngineConfig):
        cls = sections[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            result.append(ConfigField(section.name, f, _base_type(hints[f.name])))
    return result


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def engine_config(model: Optional[str | Path] = None, **options: Any) -> EngineConfig:
    """The EngineConfig for ``model`` (None: the built-in model) and options
    named like the config fields; an unknown name is a ValueError naming it."""
    by_section: dict[str, dict[str, Any]] = {}
    known = {f.name: f for f in config_fields()}
    for name, value in options.items():
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown engine option {name!r} ({hint}the options are the fields of octavo.config)")
        by_section.setdefault(known[name].section, {})[name] = value
    model_section = by_section.setdefault("model", {})
    resolved = model_section["model"] = resolve_model_path(model)
    if Path(resolved).name == SMOLLM2.filename:
        model_section.setdefault("served_model_name", (SMOLLM2.name,))
    elif model is not None and not os.path.exists(model) and Path(resolved) != MINI_MODEL_PATH:
        # A hub id: served (and reported) under the id the user typed, not the snapshot's hash folder.
        model_section.setdefault("served_model_name", (str(model),))
    speculative = by_section.get("speculative", {})
    if speculative.get("speculative_model") is not None:
        speculative["speculative_model"] = resolve_draft_path(speculative["speculative_model"])
    sections = typing.get_type_hints(EngineConfig)
    return EngineConfig(**{name: sections[name](**values) for name, values in by_section.items()})


def resolve_draft_path(draft: str | Path) -> str:
    """A draft model folder, or the name of the shipped draft (octavo-mini-draft)."""
    if str(draft) == MINI_DRAFT_MODEL_PATH.name and not os.path.isdir(draft):
        return str(MINI_DRAFT_MODEL_PATH)
    if not os.path.isdir(draft):
        raise ValueError(f"speculative_model folder not found: {draft}")
    return str(draft)


def resolve_model_path(model: Optional[str | Path]) -> str:
    """The local checkpoint for ``model``: a folder or GGUF file as given, a
    hub id from the Hugging Face cache (or downloaded); None or
    "smollm2-135m-instruct" the default model (fetched on first use; octavo-mini
    where it cannot be had), "octavo-mini" the shipped test model."""
    # Checked here so a typo is one line of error, not an engine start-up traceback.
    if model is not None and (os.path.isdir(model) or os.path.isfile(model)):
        return str(model)
    if model is None or str(model) == SMOLLM2.name:
        return str(default_model() or MINI_MODEL_PATH)
    if str(model) == MINI_MODEL_PATH.name:
        return str(MINI_MODEL_PATH)
    if looks_like_hub_id(str(model)):
        return resolve_hub_model(str(model))
    raise ValueError(f"model folder not found: {model}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """MODEL (positional) and one ``--field-name`` option per other config field.
    Options left out stay out of the namespace: the dataclass default applies."""
    for cf in config_fields():
        meta = cf.field.metadata
        if cf.name == "model":
            parser.add_argument("model", nargs="?", default=None, help=meta["help"])
            parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                                help="the same as MODEL (vLLM's spelling)")
            continue
        names = [cf.flag, *meta.get("aliases", ())]
        kwargs: dict[str, Any] = {"dest": cf.name, "default": argparse.SUPPRESS, "help": help_text(cf)}
        if cf.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction  # --x and --no-x
        elif typing.get_origin(cf.type) is tuple:  # several values: --name a b
            kwargs["type"] = typing.get_args(cf.type)[0]
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = _PARSERS.get(meta.get("unit"), cf.type)
            kwargs["choices"] = meta.get("choices")
        parser.add_argument(*names, **kwargs)


def help_text(cf: ConfigField) -> str:
    """The field's help with its default, unless the help states the default itself."""
    text = cf.field.metadata.get("help", "")
    if "default" in text.lower():
        return text
    return f"{text} (default: {'none' if cf.field.default is None else cf.field.default})"


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line, less MODEL: ``LLM(args.model, **these)``."""
    return {cf.name: getattr(args, cf.name) for cf in config_fields() if cf.name != "model" and hasattr(args, cf.name)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return engine_config(args.model, **engine_options(args))


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


# Option units -> their parsers (after the parsers are defined).
_PARSERS: dict[Optional[str], Any] = {"bytes": parse_bytes, "tokens": parse_count}
