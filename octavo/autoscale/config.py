"""``octavo autoscale``'s configuration: one dataclass tree, read from an
optional YAML file (nested like the dataclasses) with command-line flags on
top. Flags are generated from the fields: a section's fields are
``--section-field`` (``--local-serve-args``, ``--predictive-horizon-s``),
the policy's own fields are plain (``--min-replicas``)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from octavo.autoscale.actuators.kubernetes import KubernetesConfig
from octavo.autoscale.actuators.local import LocalConfig
from octavo.autoscale.policy import AutoscalerConfig
from octavo.config import option

SIGNAL_SOURCES = ("scrape", "prometheus")
ACTUATORS = ("local", "kubernetes")
# The policy's fields are the command's own: no prefix.
_UNPREFIXED = ("policy",)


@dataclass
class AutoscaleConfig:
    policy: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    interval_s: float = option(15.0, "seconds between decisions (HPA's sync period)")
    signals: str = option("scrape", "where metrics come from: the replicas' (and gateway's) /metrics, "
                                    "or Prometheus' HTTP API", choices=SIGNAL_SOURCES)
    prometheus_url: Optional[str] = option(None, "Prometheus base URL (with --signals prometheus)")
    gateway_url: Optional[str] = option(None, "the gateway: replicas are registered there (local) and its "
                                              "arrival counters measure the request rate")
    admin_key: Optional[str] = option(None, "the gateway's admin key (default: $OCTAVO_GATEWAY_ADMIN_KEY)")
    actuator: str = option("local", "what runs the replicas", choices=ACTUATORS)
    local: LocalConfig = field(default_factory=LocalConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    log_level: str = option("info", "log level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if not (self.interval_s > 0):
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.signals not in SIGNAL_SOURCES:
            raise ValueError(f"signals must be one of {', '.join(SIGNAL_SOURCES)}; got {self.signals!r}")
        if self.actuator not in ACTUATORS:
            raise ValueError(f"actuator must be one of {', '.join(ACTUATORS)}; got {self.actuator!r}")
        if self.signals == "prometheus" and not self.prometheus_url:
            raise ValueError("prometheus_url is required with signals prometheus")
        if self.actuator == "local" and not self.local.serve_args:
            raise ValueError("local.serve_args: the replicas' `octavo serve` arguments are required "
                             "(at least the model folder)")
        if self.actuator == "kubernetes" and self.signals == "scrape" and not self.gateway_url:
            raise ValueError("signals scrape with actuator kubernetes needs gateway_url (pods are not "
                             "listed here); or use signals prometheus")
        if self.admin_key is None:
            self.admin_key = os.environ.get("OCTAVO_GATEWAY_ADMIN_KEY")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _flag(path: tuple[str, ...]) -> str:
    parts = [p for p in path if p not in _UNPREFIXED]
    return "--" + "-".join(parts).replace("_", "-")


def _walk(cls: type, path: tuple[str, ...] = ()) -> typing.Iterator[tuple[tuple[str, ...], dataclasses.Field, Any]]:
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        hint = _base(hints[f.name])
        if dataclasses.is_dataclass(hint):
            yield from _walk(hint, path + (f.name,))
        else:
            yield path + (f.name,), f, hint


def _targets(text: str) -> tuple[str, float]:
    signal, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return signal.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not SIGNAL=VALUE: {text!r} (e.g. waiting=4)") from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per leaf field; flags not given stay out of the namespace
    (SUPPRESS), so the YAML file and the defaults apply beneath them."""
    for path, f, hint in _walk(AutoscaleConfig):
        help_text = f.metadata.get("help", "")
        kwargs: dict[str, Any] = {"dest": ".".join(path), "default": argparse.SUPPRESS}
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is dict:  # the reactive targets: --reactive-targets waiting=4 kv_usage=0.8
            kwargs.update(type=_targets, nargs="+", metavar="SIGNAL=VALUE")
        elif path[-1] == "serve_args":  # one shell-quoted string: "/models/x --dtype bfloat16"
            kwargs["type"] = shlex.split
        elif typing.get_origin(hint) is tuple:
            kwargs.update(type=typing.get_args(hint)[0], nargs="+")
        else:
            kwargs.update(type=hint, choices=f.metadata.get("choices"))
        if hint is not bool and not kwargs.get("choices"):
            kwargs.setdefault("metavar", path[-1].upper())
        shown = f" (default: {default})" if default not in (None, (), {}) else ""
        parser.add_argument(_flag(path), help=help_text + shown, **kwargs)
    parser.add_argument("--config", default=None, help="YAML file of these settings, nested like the flags' "
                                                       "sections (policy, reactive, predictive, local, kubernetes)")


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    """A dataclass from a mapping; unknown keys are errors naming the path."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping")
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where + '.' if where else ''}{unknown[0]}: unknown setting")
    kwargs = {}
    for name, value in data.items():
        hint = _base(hints[name])
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value, f"{where}.{name}" if where else name)
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def load_config(args: argparse.Namespace) -> AutoscaleConfig:
    """The YAML file (if any), then the flags given, into one validated config."""
    data: dict[str, Any] = {}
    if args.config is not None:
        import yaml

        try:
            data = yaml.safe_load(Path(args.config).read_text()) or {}
        except OSError as exc:
            raise ValueError(f"--config: cannot read {args.config}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"--config: {args.config} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config: {args.config} must hold a mapping")
    for path, _, hint in _walk(AutoscaleConfig):
        key = ".".join(path)
        if key not in vars(args):
            continue
        value = getattr(args, key)
        if typing.get_origin(hint) is dict:
            value = dict(value)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _build(AutoscaleConfig, data, "")
