"""Write prometheusrule.yaml from deploy/prometheus/alerts.yaml.

The Prometheus Operator takes rules inside a PrometheusRule object, not as a rule file; generating it keeps one
source of rules, the one `promtool test rules` checks. Run after editing alerts.yaml:
    python deploy/k8s/monitoring/render_prometheusrule.py
"""
from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parents[1] / "prometheus" / "alerts.yaml"
OUTPUT = HERE / "prometheusrule.yaml"


def render(alerts: Path = ALERTS) -> str:
    groups = yaml.safe_load(alerts.read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "octavo", "labels": {"app.kubernetes.io/name": "octavo"}},
        "spec": {"groups": groups},
    }
    header = "# Generated from deploy/prometheus/alerts.yaml by render_prometheusrule.py: edit that file, then rerun.\n"
    return header + yaml.safe_dump(rule, sort_keys=False, width=120)


if __name__ == "__main__":
    OUTPUT.write_text(render())
