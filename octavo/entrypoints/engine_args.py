"""One path from user options to an EngineConfig.

The command line (``octavo serve``, ``octavo generate``) and ``LLM(model,
**kwargs)`` take the same names: the fields of EngineConfig's sections
(``ModelConfig``, ``CacheConfig``, ...), ``--field-name`` on the command line.
Options are generated from the dataclasses, so a new config field is
reachable from both at once, with its default and help from one place.
"""
from __future__ import annotations

import argparse
import difflib
import os
import typing
from pathlib import Path
from typing import Any, Optional

from octavo.assets import MINI_DRAFT_MODEL_PATH, MINI_MODEL_PATH
from octavo.assets.default_model import SMOLLM2, default_model
from octavo.config import EngineConfig
from octavo.entrypoints.hub import looks_like_hub_id, resolve_hub_model
from octavo.entrypoints.options import Option, add_options, dataclass_options


def config_fields() -> list[Option]:
    """Every field of every section of EngineConfig, in declaration order."""
    return dataclass_options(EngineConfig)


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


def add_engine_args(parser: argparse.ArgumentParser) -> list[Option]:
    """MODEL (positional, or ``--model``) and one ``--field-name`` option per other config field; returns the
    options. Options left out stay out of the namespace: the dataclass default applies."""
    fields = config_fields()
    model = next(o for o in fields if o.name == "model")
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=model.meta["help"])
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the same as MODEL (vLLM's spelling; default: none)")
    add_options(parser, [o for o in fields if o is not model])
    return fields


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line, less MODEL: ``LLM(args.model, **these)``."""
    return {cf.name: getattr(args, cf.name) for cf in config_fields() if cf.name != "model" and hasattr(args, cf.name)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return engine_config(getattr(args, "model", None), **engine_options(args))
