"""``octavo autoscale``'s configuration: one dataclass tree. Its command-line
options and config file come from the fields (octavo/entrypoints/options.py):
a section's fields are ``--section-field`` (``--local-serve-args``,
``--predictive-horizon-s``), the policy's own fields are plain
(``--min-replicas``); the YAML file nests like the dataclasses."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from octavo.autoscale.actuators.kubernetes import KubernetesConfig
from octavo.autoscale.actuators.local import LocalConfig
from octavo.autoscale.policy import AutoscalerConfig
from octavo.config import option, section

SIGNAL_SOURCES = ("scrape", "prometheus")
ACTUATORS = ("local", "kubernetes")


@dataclass
class AutoscaleConfig:
    policy: AutoscalerConfig = section(AutoscalerConfig)
    interval_s: float = option(15.0, "seconds between decisions (HPA's sync period)")
    signals: str = option("scrape", "where metrics come from: the replicas' (and gateway's) /metrics, "
                                    "or Prometheus' HTTP API", choices=SIGNAL_SOURCES)
    prometheus_url: Optional[str] = option(None, "Prometheus base URL (with --signals prometheus)")
    gateway_url: Optional[str] = option(None, "the gateway: replicas are registered there (local) and its "
                                              "arrival counters measure the request rate")
    admin_key: Optional[str] = option(None, "the gateway's admin key (default: $OCTAVO_GATEWAY_ADMIN_KEY)")
    actuator: str = option("local", "what runs the replicas", choices=ACTUATORS)
    local: LocalConfig = section(LocalConfig, prefixed=True)
    kubernetes: KubernetesConfig = section(KubernetesConfig, prefixed=True)
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
