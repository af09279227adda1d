"""One request's tokenization or template rendering must not stall other clients.

A 7.9 MB prompt used to block /health for ~10 s: tokenization ran on the
event loop and HF ``Tokenizer.encode`` holds the GIL throughout. Both now run
in a thread (``encode_batch`` releases the GIL). Latencies are judged by the
median of many probes, which a loaded 2-core machine does not move much.
"""
from __future__ import annotations

import statistics
import threading
import time

import httpx

SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _probe_health_while(url: str, work) -> tuple[list[float], float, httpx.Response]:
    """Run ``work()`` in a thread; time /health probes until it returns."""
    result: dict = {}

    def run() -> None:
        start = time.monotonic()
        result["response"] = work()
        result["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    latencies = []
    with httpx.Client(base_url=url, timeout=30.0) as client:
        thread.start()
        time.sleep(0.2)  # let the request's body upload and its work start
        while thread.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    thread.join()
    return latencies, result["elapsed"], result["response"]


def test_huge_prompt_does_not_block_health(tuned_server):
    prompt = ("def foo(x):\n    return x * 2  # comment " * 100_000)[:4_000_000]

    def work() -> httpx.Response:
        return httpx.post(tuned_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120)

    latencies, elapsed, response = _probe_health_while(tuned_server.url, work)
    assert response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]
    assert len(latencies) >= 5, (elapsed, latencies)  # the probes overlapped the tokenization
    assert statistics.median(latencies) < 0.1, latencies


def test_slow_chat_template_is_cut_off_without_blocking_health(tuned_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": SLOW_TEMPLATE, "max_tokens": 1}

    def work() -> httpx.Response:
        return httpx.post(tuned_server.url + "/v1/chat/completions", json=body, timeout=60)

    latencies, elapsed, response = _probe_health_while(tuned_server.url, work)
    err = response.json()["error"]
    assert response.status_code == 400 and err["param"] == "messages" and "time limit" in err["message"], err
    assert 1.5 <= elapsed < 30  # --max-template-seconds 1.5; the loop alone would take hours
    assert len(latencies) >= 5 and statistics.median(latencies) < 0.1, latencies
