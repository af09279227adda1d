"""docker-compose.yaml: its services wire up (gateway -> replicas, Prometheus -> targets, Grafana -> dashboard)
and every command in it is one Octavo accepts."""
from __future__ import annotations

import shutil
import subprocess
from urllib.parse import urlparse

import pytest
import yaml

from octavo.entrypoints.cli import gateway_config
from tests.deploy.manifests import DEPLOY, check_octavo_command, dockerfile_instructions, exec_form, octavo_args

COMPOSE = DEPLOY / "compose" / "docker-compose.yaml"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _entrypoint() -> list[str]:
    return exec_form(dict(dockerfile_instructions("base"))["ENTRYPOINT"])


def test_replicas_run_valid_serve_commands(services: dict) -> None:
    replicas = [name for name, spec in services.items() if spec.get("image") == "octavo:cpu" and "entrypoint" not in spec]
    assert len(replicas) == 2
    for name in replicas:
        check_octavo_command(_entrypoint() + services[name]["command"])


def test_gateway_routes_to_the_compose_replicas(services: dict) -> None:
    gateway = services["gateway"]
    command = gateway["entrypoint"] + gateway["command"]
    check_octavo_command(command)
    config = gateway_config(octavo_args(command))
    hosts = {urlparse(url).hostname for url in config.replicas}
    assert hosts == {"replica-1", "replica-2"} <= services.keys()
    assert urlparse(config.redis_url).hostname in services
    assert set(gateway["depends_on"]) >= hosts


def test_prometheus_scrapes_every_octavo_process_and_loads_the_alert_rules(services: dict) -> None:
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in services["prometheus"]["volumes"]}
    config = yaml.safe_load((COMPOSE.parent / mounts["/etc/prometheus/prometheus.yml"]).read_text())
    targets = {target for job in config["scrape_configs"] for group in job["static_configs"] for target in group["targets"]}
    assert targets == {"replica-1:8000", "replica-2:8000", "gateway:8000"}
    # Relative rule files resolve against the config file's folder, where the rules are mounted.
    assert [f"/etc/prometheus/{name}" for name in config["rule_files"]] == ["/etc/prometheus/alerts.yaml"]
    assert (COMPOSE.parent / mounts["/etc/prometheus/alerts.yaml"]).is_file()


def test_mounted_files_exist_and_images_are_pinned(services: dict) -> None:
    for name, spec in services.items():
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).is_file(), f"{name} mounts missing {source}"
        image = spec["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag ({image})"


def test_grafana_provisions_the_dashboard_from_its_mount(services: dict) -> None:
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in services["grafana"]["volumes"]}
    provider = yaml.safe_load((COMPOSE.parent / mounts["/etc/grafana/provisioning/dashboards/octavo.yaml"]).read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert any(target.startswith(folder + "/") for target in mounts)
    datasource = yaml.safe_load((COMPOSE.parent / mounts["/etc/grafana/provisioning/datasources/octavo.yaml"]).read_text())
    assert urlparse(datasource["datasources"][0]["url"]).hostname == "prometheus"


def _compose_command() -> list[str]:
    """docker compose (v2 plugin) where present, else Debian's docker-compose (what .ci/run installs)."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is None:
        pytest.fail("docker-compose is missing: apt-get install docker-compose (.ci/run does)")
    return [legacy]


def test_docker_compose_accepts_the_file() -> None:
    # Validates against the Compose specification without a Docker daemon.
    result = subprocess.run([*_compose_command(), "-f", str(COMPOSE), "config", "--quiet"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
