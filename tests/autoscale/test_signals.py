"""Signals: the replicas' /metrics scraped directly, and a real Prometheus
(Debian's package) scraping the same pages, queried with the default PromQL."""
from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import httpx
import pytest

from octavo.autoscale.signals import PromQueries, PrometheusSignals, ScrapeSignals, bucket_quantile, parse_metrics
from tests.server.conftest import free_port

TTFT_BOUNDS = (0.1, 0.5, 1.0)


def page(waiting: float, running: float, kv: float, finished: float, ttft_counts: tuple[float, ...]) -> str:
    """A replica's /metrics in the names `octavo serve` exports (cumulative TTFT bucket counts)."""
    lines = [
        f'octavo:num_requests_waiting{{model_name="m"}} {waiting}',
        f'octavo:num_requests_running{{model_name="m"}} {running}',
        f'octavo:kv_cache_usage_perc{{model_name="m"}} {kv}',
        "# TYPE octavo:e2e_request_latency_seconds histogram",
        f'octavo:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="m"}} {finished}',
        f'octavo:e2e_request_latency_seconds_count{{model_name="m"}} {finished}',
        f'octavo:e2e_request_latency_seconds_sum{{model_name="m"}} {finished}',
        "# TYPE octavo:time_to_first_token_seconds histogram",
    ]
    for bound, count in zip(TTFT_BOUNDS + (math.inf,), ttft_counts):
        le = "+Inf" if math.isinf(bound) else str(bound)
        lines.append(f'octavo:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {count}')
    lines.append(f'octavo:time_to_first_token_seconds_count{{model_name="m"}} {ttft_counts[-1]}')
    lines.append('octavo:time_to_first_token_seconds_sum{model_name="m"} 0')
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``render()`` at /metrics, whatever it returns at that moment."""

    def __init__(self, render: Callable[[], str]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                data = render().encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.url = f"http://{self.address}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_bucket_quantile_interpolates_like_histogram_quantile():
    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 100.0), (math.inf, 100.0)]
    assert bucket_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (99 - 60) / 40)
    assert bucket_quantile(0.05, buckets) == pytest.approx(0.05)
    # Past the highest finite bound: that bound (Prometheus does the same).
    assert bucket_quantile(0.99, [(0.1, 1.0), (math.inf, 100.0)]) == 0.1
    assert bucket_quantile(0.99, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_scrape_signals_rates_from_successive_scrapes():
    state = {"a": page(2, 3, 0.25, 100, (10, 20, 30, 30)), "b": page(1, 1, 0.75, 50, (0, 0, 0, 0))}
    servers = {name: MetricsServer(lambda name=name: state[name]) for name in state}
    try:
        signals = ScrapeSignals(lambda: [s.url for s in servers.values()])
        first = signals.sample(1000.0)
        assert (first.replicas, first.waiting, first.running) == (2, 3, 4)
        assert first.kv_usage == pytest.approx(0.5)
        assert first.request_rate == 0.0 and first.ttft_p99 is None  # no earlier scrape to difference
        # 10 s later: 40 + 10 more requests finished; 50 new first tokens on a: 40 under 0.1 s, 10 over 1 s.
        state["a"] = page(0, 1, 0.5, 140, (50, 60, 70, 80))
        state["b"] = page(0, 0, 0.0, 60, (0, 0, 0, 0))
        second = signals.sample(1010.0)
        assert second.request_rate == pytest.approx(5.0)
        # The p99 falls in +Inf: the highest finite bound, as histogram_quantile answers.
        assert second.ttft_p99 == 1.0
        # A replica that stops answering leaves the sample (and its history).
        servers["b"].close()
        third = signals.sample(1020.0)
        assert third.replicas == 1
    finally:
        servers["a"].close()


def test_parse_metrics_reads_the_gateways_arrivals():
    text = ('octavo_gateway:requests_total{replica="http://a",code="200"} 7\n'
            'octavo_gateway:requests_total{replica="http://b",code="503"} 2\n'
            "octavo_gateway:unavailable_total 3\n")
    assert parse_metrics(text).gateway_requests == 12


@pytest.fixture
def prometheus(tmp_path):
    """Two fake replicas whose counters grow at known rates, scraped every second by a real Prometheus."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (Debian package prometheus; .ci/run installs it)")
    t0 = time.monotonic()

    def replica(finished_per_s: float, waiting: float, kv: float) -> Callable[[], str]:
        def render() -> str:
            n = (time.monotonic() - t0) * finished_per_s
            # Of the first tokens: 60% under 0.1 s, 30% in (0.1, 0.5], 10% in (0.5, 1].
            return page(waiting, 2, kv, n, (0.6 * n, 0.9 * n, n, n))
        return render

    replicas = [MetricsServer(replica(4.0, 1, 0.2)), MetricsServer(replica(6.0, 3, 0.6))]
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: octavo\n"
        f"    static_configs: [{{targets: [{', '.join(repr(r.address) for r in replicas)}]}}]\n"
    )
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", Path(tmp_path / "prometheus.log")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        for r in replicas:
            r.close()


def test_prometheus_signals_with_the_default_queries(prometheus):
    url, log = prometheus
    # A 5 s rate() window (the default is 1m): rate() divides by the whole window, so it reads
    # low until Prometheus holds that much history; wait for it, then compare.
    signals = PrometheusSignals(url, PromQueries.window("5s"))
    deadline = time.monotonic() + 90
    sample = None
    while time.monotonic() < deadline:
        try:
            sample = signals.sample(time.time())
        except httpx.HTTPError:
            sample = None  # Prometheus still starting
        if sample is not None and sample.replicas == 2 and abs(sample.request_rate - 10.0) < 1.0:
            break
        time.sleep(0.5)
    assert sample is not None and sample.replicas == 2, log.read_text()[-3000:]
    assert (sample.waiting, sample.running) == (4, 4)
    assert sample.kv_usage == pytest.approx(0.4)
    # 4 + 6 requests/s finished (no gateway scraped: the replicas' own counters).
    assert sample.request_rate == pytest.approx(10.0, rel=0.1)
    # p99 of that mix: rank 0.99 in the (0.5, 1] bucket holding the top 10%: 0.5 + 0.5 * 0.9.
    assert sample.ttft_p99 == pytest.approx(0.95, rel=0.02)
    with pytest.raises(RuntimeError, match="series"):
        signals.query("octavo:num_requests_waiting")  # two series: the query must aggregate
