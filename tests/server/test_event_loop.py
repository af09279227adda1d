"""One request's body, tokenization or template rendering must not stall other clients.

A 7.9 MB prompt used to block /health for ~10 s: tokenization ran on the
event loop and HF ``Tokenizer.encode`` holds the GIL throughout. Both now run
in a thread (``encode_batch`` releases the GIL). Bodies are parsed and
validated in a thread too, after a bound on their arrays' lengths (a 10 MB
array of token ids ending in a string blocked /health for over 5 s).
Latencies are judged by the median of many probes, which a loaded 2-core
machine does not move much.
"""
from __future__ import annotations

import json
import statistics
import threading
import time

import httpx

SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _probe_health_while(url: str, work, settle_s: float = 0.2) -> tuple[list[float], float, httpx.Response]:
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
        time.sleep(settle_s)  # let the request's body upload and its work start
        while thread.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    thread.join()
    return latencies, result["elapsed"], result["response"]


def test_huge_prompt_is_tokenized_without_blocking_health(tuned_server):
    prompt = ("def foo(x):\n    return x * 2  # comment " * 100_000)[:4_000_000]

    def work() -> httpx.Response:
        return httpx.post(tuned_server.url + "/tokenize", json={"prompt": prompt}, timeout=120)

    latencies, elapsed, response = _probe_health_while(tuned_server.url, work)
    assert response.status_code == 200 and response.json()["count"] > 100_000
    assert len(latencies) >= 5, (elapsed, latencies)  # the probes overlapped the tokenization
    assert statistics.median(latencies) < 0.1, latencies


def test_hopeless_prompt_is_refused_before_tokenizing(tuned_server):
    """Longer than the context can be whatever its tokens: refused by its
    length in characters, not after seconds of tokenizing."""
    max_len = httpx.get(tuned_server.url + "/v1/models").json()["data"][0]["max_model_len"]
    for path, body in (("/v1/completions", {"prompt": "x" * 4_000_000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 4_000_000}]})):
        r = httpx.post(tuned_server.url + path, json={**body, "max_tokens": 1}, timeout=120)
        err = r.json()["error"]
        assert r.status_code == 400 and f"maximum context length is {max_len} tokens" in err["message"], err
        assert "characters, more than" in err["message"]  # the length check, not the tokenized count
    # Just over the context, yet short: tokenized and counted as before.
    r = httpx.post(tuned_server.url + "/v1/completions", json={"prompt": "word " * 600, "max_tokens": 1})
    assert r.status_code == 400 and "you requested" in r.json()["error"]["message"]


def test_large_array_body_does_not_block_health(tuned_server):
    """10 MB of token ids with a string at the end: pydantic's error around
    the whole array took over 5 s on the event loop."""
    raw = json.dumps({"prompt": list(range(100, 400)) * 7000 + ["x"], "max_tokens": 1}).encode()

    def work() -> httpx.Response:
        return httpx.post(tuned_server.url + "/v1/completions", content=raw,
                          headers={"content-type": "application/json"}, timeout=120)

    latencies, elapsed, response = _probe_health_while(tuned_server.url, work, settle_s=0.0)
    err = response.json()["error"]
    assert response.status_code == 400 and err["param"] == "prompt" and "2100001 items" in err["message"], err
    assert latencies and statistics.median(latencies) < 0.1, latencies
    assert max(latencies) < 2.0, latencies  # JSON decoding holds the GIL for a few tenths of a second


def test_slow_chat_template_is_cut_off_without_blocking_health(tuned_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": SLOW_TEMPLATE, "max_tokens": 1}

    def work() -> httpx.Response:
        return httpx.post(tuned_server.url + "/v1/chat/completions", json=body, timeout=60)

    latencies, elapsed, response = _probe_health_while(tuned_server.url, work)
    err = response.json()["error"]
    assert response.status_code == 400 and err["param"] == "messages" and "time limit" in err["message"], err
    assert 1.5 <= elapsed < 30  # --max-template-seconds 1.5; the loop alone would take hours
    assert len(latencies) >= 5 and statistics.median(latencies) < 0.1, latencies
