"""deploy/prometheus: promtool checks the rules and the config and runs the rules' unit tests;
every rule is tested firing and not firing, has its runbook, and reads only metrics Octavo exports."""
from __future__ import annotations

import re
import subprocess

import yaml

from tests.deploy.monitoring import DEPLOY, REPO, documented, names_in, require_binary

RULES = DEPLOY / "prometheus" / "alerts.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("promtool"), *args], capture_output=True, text=True, timeout=120)


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules_and_the_scrape_config():
    for args in (("check", "rules", str(RULES)), ("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))):
        result = promtool(*args)
        assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass():
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_every_rule_is_tested_firing_and_not_firing():
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names))
    assert {name: cases.get(name, set()) for name in names} == {name: {True, False} for name in names}


def test_every_rule_has_a_runbook_and_reads_exported_metrics():
    headings = {line[3:].strip().lower() for line in (REPO / "docs" / "RUNBOOK.md").read_text().splitlines()
                if line.startswith("## ")}
    exported = set.union(*documented().values()) | {"up"}
    for rule in alerts():
        notes = rule["annotations"]
        assert notes.get("summary") and notes.get("description"), rule["alert"]
        anchor = re.fullmatch(r"docs/RUNBOOK\.md#(\w+)", notes["runbook_url"])
        assert anchor and anchor.group(1) in headings, rule["alert"]
        assert anchor.group(1) == rule["alert"].lower()
        assert rule["labels"]["severity"] in ("warning", "critical")
        unknown = names_in(rule["expr"]) - exported
        assert not unknown, (rule["alert"], unknown)
    seeds = {rule["alert"]: rule["labels"].get("action") for rule in alerts() if rule["labels"].get("action")}
    assert seeds == {"OctavoP99LatencyHigh": "scale_out", "OctavoKVCacheNearFull": "shed_low_priority"}
