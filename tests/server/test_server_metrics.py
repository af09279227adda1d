"""Each metric moves as it should under real requests (the refusal counter
under a burst: test_load.py; the timeout counter: test_request_faults.py)."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

BUDGET, SEATS, BLOCKS = 256, 4, 128


@pytest.fixture(scope="module")
def srv(model_path, tmp_path_factory):
    server = ServerProcess(model_path, tmp_path_factory.mktemp("metrics") / "server.log",
                           "--num-blocks", str(BLOCKS), "--max-num-seqs", str(SEATS),
                           "--max-num-batched-tokens", str(BUDGET), "--max-n", "2", "--max-model-len", "512")
    yield server
    server.stop()


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def complete(srv: ServerProcess, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", headers=srv.headers, timeout=120,
                      json={"max_tokens": 5, "temperature": 0, "ignore_eos": True, **body})


def test_per_request_and_per_step_histograms(srv):
    before = srv.wait_idle()
    # One at a time, distinct first tokens (no prefix-cache hits): each request
    # is one 20-token prefill step and 4 one-token decode steps of one sequence.
    for first in (11, 12, 13):
        assert complete(srv, prompt=[first] + [7] * 19).status_code == 200
    after = srv.wait_idle()

    def d(key: str) -> float:
        return delta(after, before, f"octavo:{key}")

    assert d("prefix_cache_hits_total") == 0
    assert d("request_prompt_tokens_count") == 3 and d("request_prompt_tokens_sum") == 60
    assert d("request_generation_tokens_count") == 3 and d("request_generation_tokens_sum") == 15
    assert d("request_prompt_tokens_bucket[le=20.0]") == 3 and d("request_prompt_tokens_bucket[le=10.0]") == 0
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time", "time_per_output_token"):
        assert d(f"request_{name}_seconds_count") == 3, name
    # Phases of one clock: inference = prefill + decode, and the front sees
    # the first token only after the engine made it (queue + prefill <= TTFT).
    assert d("request_inference_time_seconds_sum") == pytest.approx(
        d("request_prefill_time_seconds_sum") + d("request_decode_time_seconds_sum"), abs=1e-6)
    assert d("request_queue_time_seconds_sum") + d("request_prefill_time_seconds_sum") <= (
        d("time_to_first_token_seconds_sum") + 1e-6)
    assert d("e2e_request_latency_seconds_sum") >= d("request_inference_time_seconds_sum")
    # Per step: 3 x (a 20-token prefill + 4 decodes), each step one sequence.
    assert d("iteration_tokens_total_count") == 15 and d("iteration_tokens_total_sum") == 72
    assert d("iteration_tokens_total_bucket[le=1.0]") == 12 and d("iteration_tokens_total_bucket[le=32.0]") == 15
    assert d("batch_token_utilization_count") == 15
    assert d("batch_token_utilization_sum") == pytest.approx(72 / BUDGET)
    assert d("batch_seq_utilization_sum") == pytest.approx(15 / SEATS)
    assert d("batch_seq_utilization_bucket[le=0.3]") == 15 and d("batch_seq_utilization_bucket[le=0.2]") == 0


def test_queue_time_is_the_wait_for_the_engine(srv):
    """The engine stopped for 2 s: the request's queue time holds most of them (the front stamps
    its arrival after parsing and tokenizing it, which on a loaded machine takes a moment)."""
    before = srv.wait_idle()
    engine = srv.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    result: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: result.append(complete(srv, prompt="stopped engine", max_tokens=2)))
    try:
        worker.start()
        time.sleep(2.0)
    finally:
        os.kill(engine, signal.SIGCONT)
    worker.join(120)
    assert result and result[0].status_code == 200
    after = srv.wait_idle()
    assert delta(after, before, "octavo:request_queue_time_seconds_count") == 1
    queue = delta(after, before, "octavo:request_queue_time_seconds_sum")
    assert queue >= 1.0
    assert queue <= delta(after, before, "octavo:time_to_first_token_seconds_sum")


def test_refusals_by_limit_and_http_metrics(srv):
    before = srv.metrics()
    assert complete(srv, prompt="hi", n=3).status_code == 400  # --max-n 2
    assert complete(srv, prompt=[5] * 500, max_tokens=100).status_code == 400  # over --max-model-len 512
    assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 401  # no key
    assert complete(srv, prompt="hi").status_code == 200
    for _ in range(3):  # probes and scrapes are left out of the HTTP metrics
        httpx.get(srv.url + "/health", timeout=30)
    after = srv.metrics()
    assert delta(after, before, "octavo:requests_refused_total[reason=request_limit]") == 1
    assert delta(after, before, "octavo:requests_refused_total[reason=context_length]") == 1
    route = "[handler=/v1/completions][method=POST]"
    assert delta(after, before, f"http_requests_total{route}[status=400]") == 2
    assert delta(after, before, f"http_requests_total{route}[status=200]") == 1
    assert delta(after, before, "http_requests_total[handler=/v1/models][method=GET][status=401]") == 1
    assert delta(after, before, f"http_request_duration_seconds_count{route}[status=200]") == 1
    assert not [k for k in after if "handler=/health" in k or "handler=/metrics" in k]


def test_cache_config_info_and_process_metrics(srv):
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    info = next(line for line in text.splitlines() if line.startswith("octavo:cache_config_info{"))
    for label in ('block_size="16"', f'num_blocks="{BLOCKS}"', 'enable_prefix_caching="true"', 'cache_dtype="auto"'):
        assert label in info
    assert info.endswith(" 1.0")
    before = srv.metrics()
    assert complete(srv, prompt="spend some engine time", max_tokens=16).status_code == 200
    after = srv.wait_idle()
    # The engine process holds the weights and the KV cache: more memory than the front.
    assert after["octavo_engine_process_resident_memory_bytes"] > after["process_resident_memory_bytes"] > 0
    assert after["octavo_engine_process_cpu_seconds_total"] >= before["octavo_engine_process_cpu_seconds_total"]
    assert after["octavo:engine_restarts_total"] == 0
    assert any(k.startswith("python_info[implementation=") for k in after)
