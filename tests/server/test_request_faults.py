"""One request cannot hurt the others: a schema too deep for the engine is a
4xx, a request past --request-timeout is aborted in the engine, and a client
that stops reading its stream stalls nobody else."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.server.helpers import LONG, SSEStream, wait_for

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def srv(model_path, tmp_path_factory):
    server = ServerProcess(model_path, tmp_path_factory.mktemp("faults") / "server.log",
                           "--num-blocks", "256", "--request-timeout", str(TIMEOUT_S), "--max-body-size", "1MiB")
    yield server
    server.stop()


def deep_schema_json(depth: int) -> str:
    """JSON text of an object schema nested ``depth`` levels (built as text:
    json.dumps itself runs out of recursion a few hundred levels down)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def completion(srv: ServerProcess, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body},
                      headers=srv.headers, timeout=180)


# The HTTP edge refuses schemas past --max-schema-depth (the engine's own
# limit, for the Python API, is tested in tests/engine/test_fault_isolation.py);
# 700 levels (1400 JSON containers) do not even parse.
@pytest.mark.parametrize("depth, message", [(300, "nested"), (400, "nested"), (700, "nested too deeply")])
def test_a_too_deep_schema_is_a_4xx_and_the_server_serves_on(srv, depth, message):
    fmt = f'{{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {deep_schema_json(depth)}}}}}'
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 4, "response_format": {fmt}}}'
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, timeout=60,
                   headers={**srv.headers, "content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert message in r.json()["error"]["message"]
    assert completion(srv).status_code == 200
    srv.wait_idle()


def test_a_request_past_its_deadline_gets_504_and_frees_its_blocks(srv):
    before = srv.wait_idle()
    engine = srv.engine_pid()
    os.kill(engine, signal.SIGSTOP)  # the engine makes no progress: only the deadline can end the request
    try:
        started = time.monotonic()
        r = completion(srv, max_tokens=8)
        waited = time.monotonic() - started
    finally:
        os.kill(engine, signal.SIGCONT)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert TIMEOUT_S - 0.1 <= waited < TIMEOUT_S + 30
    after = srv.wait_idle()
    key = "octavo:request_errors_total[reason=timeout]"
    assert after[key] - before.get(key, 0) == 1


def test_a_stream_past_its_deadline_ends_with_an_in_band_error(srv):
    stream = SSEStream(srv, LONG)
    stream.start()
    wait_for(lambda: len(stream.lines) >= 2, what="the stream to start")
    engine = srv.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    try:
        stream.join(60)
    finally:
        os.kill(engine, signal.SIGCONT)
    assert stream.status == 200 and stream.lines[-1] == "[DONE]"
    assert json.loads(stream.lines[-2])["error"]["code"] == "timeout"
    srv.wait_idle()


def test_a_client_that_stops_reading_stalls_no_one(srv):
    """A raw socket asks for a long stream with logprobs (big events) and never
    reads: its socket buffers fill, its handler waits on them, and the other
    requests still finish, within the deadline. Closing it frees its blocks."""
    body = json.dumps({**LONG, "stream": True, "logprobs": 5, "max_tokens": 400}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"authorization: Bearer {srv.api_key}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    try:
        wait_for(lambda: srv.metrics()["octavo:num_requests_running"] >= 1, what="the slow request to run")
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: completion(srv, prompt=f"request {i}", max_tokens=16), range(4)))
        assert [a.status_code for a in answers] == [200] * 4
    finally:
        sock.close()
    srv.wait_idle()


def test_long_prompts_on_a_small_pool_preempt_and_all_finish(model_path, tmp_path):
    """Memory pressure is a scheduling matter: requests that together need far
    more KV blocks than the pool has are preempted and recomputed, never
    failed. (Engine level, with exact outputs: test_greedy_parity.py,
    test_preemption_gives_the_same_output.)"""
    # 48 blocks of 16 = 768 tokens; each request grows to 300 + 100 = 400.
    small = ServerProcess(model_path, tmp_path / "small-pool.log", "--num-blocks", "48")
    try:
        prompts = [[7 + i] * 300 for i in range(8)]  # distinct: no prefix sharing
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(
                lambda p: completion(small, prompt=p, max_tokens=100, ignore_eos=True, temperature=0), prompts))
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
        assert all(a.json()["usage"]["completion_tokens"] == 100 for a in answers)
        metrics = small.wait_idle()
        assert metrics["octavo:num_preemptions_total"] > 0
    finally:
        small.stop()
