"""Monitoring against live processes: `octavo serve` (tiny model) behind `octavo gateway`, scraped by a real
Prometheus (Debian's binary, 127.0.0.1, storage in a temp dir, 1 s scrapes, deploy/prometheus's config and
rules). docs/METRICS.md lists exactly what both export; a TTFT percentile comes back through Prometheus'
HTTP API under load; every Grafana panel's query parses there and reads only exported metrics."""
from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.monitoring import DEPLOY, documented, documented_buckets, names_in, require_binary
from tests.gateway.conftest import GatewayProcess
from tests.model_factory import make_tiny_model
from tests.server.conftest import ServerProcess, free_port

TTFT_P99 = "histogram_quantile(0.99, sum by (le) (rate(octavo:time_to_first_token_seconds_bucket[1m])))"
# Grafana's variables, as the dashboard's "All" would set them.
GRAFANA_VARIABLES = {"$model_name": ".*", "$__rate_interval": "1m"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitoring")
    serve = ServerProcess(make_tiny_model(root), root / "serve.log", "--num-blocks", "128", api_key=None)
    try:
        gateway = GatewayProcess(root / "gateway.log", "--replica", serve.url)
    except BaseException:
        serve.stop()
        raise
    yield serve, gateway
    gateway.stop()
    serve.stop()


class PrometheusProcess:
    """deploy/prometheus/prometheus.yml with the live targets and 1 s intervals."""

    def __init__(self, root: Path, replica: str, gateway: str) -> None:
        binary = require_binary("prometheus")
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(DEPLOY / "prometheus" / name) for name in config["rule_files"]]
        targets = {"octavo-replicas": replica, "octavo-gateway": gateway}
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(root / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not self._ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, (root / "prometheus.log").read_text()
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def query(self, promql: str) -> httpx.Response:
        return httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    serve, gateway = stack
    strip = lambda url: url.removeprefix("http://")  # noqa: E731
    prom = PrometheusProcess(tmp_path_factory.mktemp("prometheus"), strip(serve.url), strip(gateway.url))
    yield prom
    prom.stop()


def exported(url: str) -> set[str]:
    """Metric names as queries use them: counters with _total, others by their family name (the
    ``_created`` timestamps prometheus_client adds, which the text parser reads as families, left out)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {f.name + "_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


def test_metrics_doc_lists_exactly_what_is_exported(stack):
    serve, gateway = stack
    assert httpx.get(f"{serve.url}/v1/models", timeout=30).status_code == 200  # the HTTP histogram's first series
    doc = documented()
    for section, url in (("serve", serve.url), ("gateway", gateway.url)):
        live = exported(url)
        assert sorted(live - doc[section]) == [], f"exported by {section} but not in docs/METRICS.md"
        assert sorted(doc[section] - live) == [], f"in docs/METRICS.md but not exported by {section}"
    # The bucket bounds the doc gives are the ones exported.
    buckets = documented_buckets()
    assert len(buckets) >= 12
    live_bounds: dict[str, set[float]] = {}
    for url in (serve.url, gateway.url):
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                    live_bounds.setdefault(family.name, set()).add(float(sample.labels["le"]))
    for name, bounds in buckets.items():
        assert live_bounds[name] == set(bounds), name


# Panels whose emptiness is explained by what this fleet runs: no speculative decoding, a dense model.
EXPLAINED_EMPTY = {"Speculative decoding acceptance", "Expert load imbalance (max / mean)"}


def _wait_for_scrapes(prometheus: PrometheusProcess) -> None:
    deadline = time.monotonic() + 30
    while len(prometheus.query("up == 1").json()["data"]["result"]) < 2:
        assert time.monotonic() < deadline, "Prometheus did not scrape both targets"
        time.sleep(0.3)


def _empty_panels(prometheus: PrometheusProcess) -> list[tuple[str, str]]:
    """(title, query) of every panel query with no series at all ("No data" in Grafana)."""
    empty = []
    for title, expr in dashboard_queries():
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        result = prometheus.query(expr).json()
        assert result["status"] == "success", (title, result)
        if not result["data"]["result"] and title not in EXPLAINED_EMPTY:
            empty.append((title, expr))
    return empty


def test_no_panel_is_blank_on_an_idle_fleet(stack, prometheus):
    _wait_for_scrapes(prometheus)
    time.sleep(2.5)  # two scrapes more: rate() needs two samples of every series
    assert _empty_panels(prometheus) == []


def _load(gateway: GatewayProcess, seconds: float) -> list[int]:
    """Completions through the gateway from 4 threads for ``seconds``; their status codes."""
    codes: list[int] = []
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        with httpx.Client(base_url=gateway.url, timeout=120) as http:
            while time.monotonic() < stop:
                r = http.post("/v1/completions", json={"prompt": f"load {i} {len(codes)}", "max_tokens": 4,
                                                       "temperature": 0.8, "ignore_eos": True})
                codes.append(r.status_code)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def test_prometheus_returns_the_p99_ttft_under_load(stack, prometheus):
    _, gateway = stack
    # rate() needs samples from before the load: wait for the first scrapes of both.
    _wait_for_scrapes(prometheus)
    codes = _load(gateway, seconds=4.0)
    assert codes and set(codes) == {200}
    deadline = time.monotonic() + 30
    while True:
        result = prometheus.query(TTFT_P99).json()
        assert result["status"] == "success", result
        values = [float(sample["value"][1]) for sample in result["data"]["result"]]
        if values and math.isfinite(values[0]):
            break
        assert time.monotonic() < deadline, f"no finite p99 TTFT: {result}"
        time.sleep(0.5)
    assert 0 < values[0] < 80  # inside the buckets: a real percentile, not +Inf
    up = prometheus.query("up").json()["data"]["result"]
    assert {(s["metric"]["job"], s["value"][1]) for s in up} == {("octavo-replicas", "1"), ("octavo-gateway", "1")}
    groups = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert {g["name"] for g in groups} == {"octavo-serving", "octavo-availability"}
    assert all(rule["health"] == "ok" for g in groups for rule in g["rules"]), groups


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel; each panel reads the templated data source."""
    dashboard = json.loads((DEPLOY / "grafana" / "octavo.json").read_text())
    variables = {v["name"]: v["type"] for v in dashboard["templating"]["list"]}
    assert variables["datasource"] == "datasource"
    queries = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            queries.append((panel["title"], target["expr"]))
    return queries


def test_dashboard_queries_parse_and_read_exported_metrics(stack, prometheus):
    serve, gateway = stack
    live = exported(serve.url) | exported(gateway.url) | {"up"}
    queries = dashboard_queries()
    assert len(queries) >= 20
    for title, expr in queries:
        assert not names_in(expr) - live, (title, names_in(expr) - live)
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, (title, expr)
        r = prometheus.query(expr)  # a query that does not parse is a 400
        assert r.status_code == 200 and r.json()["status"] == "success", (title, r.text)
    # After the load test above: a loaded fleet leaves no panel blank either.
    assert _empty_panels(prometheus) == []
