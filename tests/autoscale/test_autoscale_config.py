"""`octavo autoscale`'s settings: YAML nested like the dataclasses, flags on top."""
from __future__ import annotations

import argparse

import pytest

from octavo.entrypoints.cli import autoscale_config as load_config, build_parser, main, parse_command


def _parse(*argv: str) -> argparse.Namespace:
    return parse_command(build_parser(), ["autoscale", *argv])[0]


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "autoscale.yaml"
    path.write_text(
        "policy:\n"
        "  max_replicas: 6\n"
        "  reactive: {targets: {waiting: 4, kv_usage: 0.8}, metric_window_s: 60}\n"
        "  predictive: {enabled: true, capacity_per_replica: 2.5, seasonal_periods_s: [86400]}\n"
        "gateway_url: http://127.0.0.1:8080\n"
        "local: {serve_args: [/models/m, --dtype, bfloat16]}\n"
    )
    config = load_config(_parse("--config", str(path), "--max-replicas", "8", "--reactive-targets", "ttft_p99=0.5",
                                "--local-serve-args", "/models/m --max-num-seqs 32", "--interval-s", "5"))
    assert config.policy.max_replicas == 8  # the flag wins
    assert config.policy.reactive.targets == {"ttft_p99": 0.5}
    assert config.policy.reactive.metric_window_s == 60  # from the file
    assert config.policy.predictive.enabled and config.policy.predictive.capacity_per_replica == 2.5
    assert config.policy.predictive.seasonal_periods_s == (86400.0,)
    assert config.local.serve_args == ("/models/m", "--max-num-seqs", "32")
    assert config.interval_s == 5 and config.gateway_url == "http://127.0.0.1:8080"


def test_errors_name_the_setting(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("policy: {reactive: {window: 3}}\n")
    with pytest.raises(ValueError, match=r"unknown option 'policy.reactive.window'"):
        load_config(_parse("--config", str(path)))
    with pytest.raises(ValueError, match="local.serve_args: --host and --port"):
        load_config(_parse("--local-serve-args", "/m --port 9000"))
    with pytest.raises(ValueError, match="prometheus_url"):
        load_config(_parse("--local-serve-args", "/m", "--signals", "prometheus"))
    with pytest.raises(SystemExit) as info:
        main(["autoscale", "--local-serve-args", "/m", "--predictive-enabled"])
    assert info.value.code == 2
    assert "predictive.capacity_per_replica must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--reactive-targets", "waiting")  # not SIGNAL=VALUE: argparse's usage error
