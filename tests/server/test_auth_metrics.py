"""API keys guard the API (not /health, /metrics); /metrics parses and its counters move."""
from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic c2stdGVzdC1rZXk="}])
def test_api_key_required(server, headers):
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("POST", "/tokenize"), ("GET", "/version")]:
        r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "hi"})
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"


def test_public_routes_and_openai_client_error(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert server.openai().models.list().data[0].id == MODEL


def test_metrics_counters_move(server):
    before = server.wait_idle()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_free_blocks",
                 "kv_total_blocks", "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert f"octavo:{name}" in before, name
    client = server.openai()
    prompt = "Paged attention stores keys and values in fixed-size blocks so memory is never wasted. " * 2
    results = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
        for _ in range(2)
    ]
    after = server.wait_idle()
    prompt_tokens = sum(r.usage.prompt_tokens for r in results)
    assert after["octavo:prompt_tokens_total"] - before["octavo:prompt_tokens_total"] == prompt_tokens
    assert after["octavo:generation_tokens_total"] - before["octavo:generation_tokens_total"] == 8
    # The second identical prompt hits the blocks the first one left in the prefix cache.
    assert after["octavo:prefix_cache_hits_total"] > before["octavo:prefix_cache_hits_total"]
    assert after["octavo:prefix_cache_queries_total"] > before["octavo:prefix_cache_queries_total"]
    key = "octavo:request_success_total[finished_reason=length]"
    assert after[key] - before.get(key, 0.0) == 2
    assert after["octavo:e2e_request_latency_seconds_count"] - before["octavo:e2e_request_latency_seconds_count"] == 2
    assert after["octavo:time_to_first_token_seconds_count"] - before["octavo:time_to_first_token_seconds_count"] == 2
    assert after["octavo:inter_token_latency_seconds_count"] > before["octavo:inter_token_latency_seconds_count"]
    assert after["octavo:request_queue_time_seconds_count"] - before["octavo:request_queue_time_seconds_count"] == 2
    assert after["octavo:kv_cache_usage_perc"] == 0.0
