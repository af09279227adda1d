"""The Kubernetes manifests: valid against the API schemas, wired to each other (selectors, ports, targets),
running commands Octavo accepts, with PromQL Prometheus parses and alert rules generated from the tested file."""
from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from octavo.entrypoints.cli import server_config_from_args
from tests.deploy.manifests import (
    DEPLOY, check_octavo_command, dockerfile_instructions, exec_form, k8s_objects, octavo_args, yaml_documents,
)
from tests.deploy.monitoring import documented, names_in
from tests.deploy.promql import check_expressions

K8S = DEPLOY / "k8s"
OBJECTS = list(k8s_objects())
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}  # CRDs: no schema in kubernetes-validate


def _of_kind(kind: str) -> list[dict]:
    return [obj for _, obj in OBJECTS if obj["kind"] == kind]


def _deployment(name: str) -> dict:
    return next(obj for obj in _of_kind("Deployment") if obj["metadata"]["name"] == name)


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


@pytest.mark.parametrize("path,obj", [pair for pair in OBJECTS if pair[1]["kind"] not in CUSTOM_KINDS],
                         ids=lambda value: value.name if isinstance(value, Path) else value["kind"])
def test_object_validates_against_the_kubernetes_schema(path: Path, obj: dict) -> None:
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_every_object_is_a_known_kind() -> None:
    assert {obj["kind"] for _, obj in OBJECTS} - CUSTOM_KINDS <= {
        "Namespace", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
        "ServiceAccount", "Role", "RoleBinding"}
    assert {obj["kind"] for _, obj in OBJECTS} >= CUSTOM_KINDS | {"PodDisruptionBudget", "HorizontalPodAutoscaler"}


@pytest.mark.parametrize("kustomization", sorted(K8S.rglob("kustomization.yaml")), ids=lambda p: str(p.parent.name))
def test_kustomization_lists_exactly_the_objects_of_its_folder(kustomization: Path) -> None:
    listed = set(yaml.safe_load(kustomization.read_text())["resources"])
    with_objects = {path.name for path in kustomization.parent.glob("*.yaml")
                    if path != kustomization and any("kind" in doc for doc in yaml_documents(path))}
    assert listed == with_objects


def test_deployments_select_their_own_pods_and_services_and_budgets_select_pods() -> None:
    pods = []
    for deployment in _of_kind("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert _selects(deployment["spec"]["selector"]["matchLabels"], labels)
        pods.append(labels)
    for service in _of_kind("Service"):
        assert sum(_selects(service["spec"]["selector"], labels) for labels in pods) == 1, service["metadata"]["name"]
    for budget in _of_kind("PodDisruptionBudget"):
        assert sum(_selects(budget["spec"]["selector"]["matchLabels"], labels) for labels in pods) == 1


def test_probes_hit_health_on_a_declared_port() -> None:
    for deployment in _of_kind("Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if "ports" not in container:  # the autoscaler serves nothing to probe
                continue
            ports = {port["name"] for port in container["ports"]}
            probes = [container[key] for key in ("startupProbe", "readinessProbe", "livenessProbe") if key in container]
            assert "readinessProbe" in container and "livenessProbe" in container
            for probe in probes:
                assert probe["httpGet"]["path"] == "/health" and probe["httpGet"]["port"] in ports


def test_replica_runs_a_valid_serve_command_publishing_events_on_its_declared_port() -> None:
    container = _deployment("octavo-replica")["spec"]["template"]["spec"]["containers"][0]
    entrypoint = exec_form(dict(dockerfile_instructions("base"))["ENTRYPOINT"])
    command = entrypoint + container["args"]
    check_octavo_command(command)
    args = octavo_args(command)
    server = server_config_from_args(args)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert server.port == ports["http"]
    assert args.kv_events_endpoint.endswith(f":{ports['kv-events']}")
    # SIGTERM drains in-flight requests for --shutdown-timeout-s; the pod must be given longer than that.
    grace = _deployment("octavo-replica")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > server.shutdown_timeout_s


def test_gateway_discovers_replicas_through_the_headless_service() -> None:
    container = _deployment("octavo-gateway")["spec"]["template"]["spec"]["containers"][0]
    command = container["command"] + container["args"]
    check_octavo_command(command)
    args = octavo_args(command)
    service = next(s for s in _of_kind("Service") if s["metadata"]["name"] == args.discovery_dns)
    assert service["spec"]["clusterIP"] == "None"  # its DNS name resolves to every pod
    assert args.discovery_port in {port["port"] for port in service["spec"]["ports"]}
    assert _selects(service["spec"]["selector"], _deployment("octavo-replica")["spec"]["template"]["metadata"]["labels"])


def test_autoscalers_target_the_replica_deployment() -> None:
    hpa = _of_kind("HorizontalPodAutoscaler")[0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "octavo-replica"
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    scaled = _of_kind("ScaledObject")[0]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "octavo-replica"
    assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_octavo_autoscaler_may_scale_exactly_the_deployment_it_scales() -> None:
    spec = _deployment("octavo-autoscaler")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    command = container["command"] + container["args"]
    check_octavo_command(command)
    args = octavo_args(command)
    deployment = getattr(args, "kubernetes.deployment")  # the autoscale parser keeps its sections in dest names
    assert args.actuator == "kubernetes" and _deployment(deployment)
    binding = _of_kind("RoleBinding")[0]
    assert binding["subjects"][0]["name"] == spec["serviceAccountName"]
    role = next(r for r in _of_kind("Role") if r["metadata"]["name"] == binding["roleRef"]["name"])
    granted = {(resource, verb) for rule in role["rules"] if deployment in rule["resourceNames"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == {("deployments", "get"), ("deployments/scale", "get"), ("deployments/scale", "patch")}


def test_hpa_metrics_are_octavo_gauges_renamed_by_the_adapter_rules() -> None:
    rules = yaml.safe_load((K8S / "autoscaling" / "hpa" / "prometheus-adapter-rules.yaml").read_text())
    rule = rules["rules"]["custom"][0]
    series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
    pattern, rename = rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1")
    exported = {name for name in documented()["serve"] if re.fullmatch(series, name)}
    renamed = {re.sub(pattern, rename, name) for name in exported}
    for hpa in _of_kind("HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            assert metric["pods"]["metric"]["name"] in renamed


def test_keda_queries_parse_and_read_exported_metrics() -> None:
    queries = [trigger["metadata"]["query"] for trigger in _of_kind("ScaledObject")[0]["spec"]["triggers"]]
    check_expressions(queries)
    for query in queries:
        assert names_in(query) <= documented()["serve"], query


def test_service_monitors_scrape_a_named_port_and_set_the_job_label() -> None:
    services = _of_kind("Service")
    for monitor in _of_kind("ServiceMonitor"):
        matched = [s for s in services if _selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(matched) == 1
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in matched[0]["spec"]["ports"]}
        assert monitor["spec"]["jobLabel"] in matched[0]["metadata"]["labels"]


def test_prometheus_rule_is_generated_from_the_tested_alert_rules() -> None:
    import importlib.util

    script = K8S / "monitoring" / "render_prometheusrule.py"
    spec = importlib.util.spec_from_file_location("render_prometheusrule", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (K8S / "monitoring" / "prometheusrule.yaml").read_text() == module.render(), \
        "prometheusrule.yaml is stale: run python deploy/k8s/monitoring/render_prometheusrule.py"

