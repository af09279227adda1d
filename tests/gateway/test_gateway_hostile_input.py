"""Requests built to hurt the gateway: oversized bodies and headers, slow
uploads, malformed headers, deeply nested JSON; every one a clear 4xx, and
the gateway goes on serving."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.gateway.conftest import EchoUpstream, GatewayProcess, raw_exchange

MAX_BODY = 65536
MAX_HEADER = 8192
BODY_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("hostile")
    echo = EchoUpstream(log_dir / "echo.log")
    gw = GatewayProcess(log_dir / "gw.log", "--replica", echo.url, "--max-body-bytes", str(MAX_BODY),
                        "--max-header-bytes", str(MAX_HEADER), "--body-timeout-s", str(BODY_TIMEOUT_S))
    yield gw
    gw.stop()
    echo.stop()


def _still_serving(gw: GatewayProcess) -> None:
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "still there?"}, timeout=30)
    assert r.status_code == 200


def _head(path: str, *lines: bytes) -> bytes:
    headers = b"".join(line + b"\r\n" for line in lines)
    return b"POST " + path.encode() + b" HTTP/1.1\r\nHost: gw\r\n" + headers + b"\r\n"


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(gateway):
    # 200 MiB announced, none of it sent: the answer comes at once, without waiting for the body.
    status, answer = raw_exchange(gateway.url, [_head("/v1/completions", b"Content-Length: %d" % (200 * 2**20))])
    assert status == 413 and b"body_too_large" in answer and b"connection: close" in answer.lower()
    _still_serving(gateway)


def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives(gateway):
    def upload():
        yield b'{"prompt": "'
        for _ in range(64):  # 4 MiB, 64 times the limit
            yield b"x" * 65536

    r = httpx.post(f"{gateway.url}/v1/completions", content=upload(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    _still_serving(gateway)


def test_headers_over_the_limit_are_431(gateway):
    big = b"x-padding: " + b"a" * (4 * MAX_HEADER)
    status, answer = raw_exchange(gateway.url, [_head("/v1/completions", big, b"Content-Length: 2") + b"{}"])
    assert status == 431 and b"headers_too_large" in answer
    # Many small headers count together.
    many = [b"x-h%d: %s" % (i, b"b" * 100) for i in range(2 * MAX_HEADER // 100)]
    status, _ = raw_exchange(gateway.url, [_head("/v1/completions", *many, b"Content-Length: 2") + b"{}"])
    assert status == 431
    # Under the limit, also when a request's headers arrive in pieces: served.
    body = b'{"prompt": "fits"}'
    head = _head("/v1/completions", b"x-padding: " + b"a" * (MAX_HEADER // 2), b"Content-Type: application/json",
                 b"Content-Length: %d" % len(body))
    status, _ = raw_exchange(gateway.url, [head[:100], head[100:], body], pause_s=0.05)
    assert status == 200
    _still_serving(gateway)


def test_a_slow_upload_is_timed_out(gateway):
    head = _head("/v1/completions", b"Content-Type: application/json", b"Content-Length: 100")
    start = time.monotonic()
    status, answer = raw_exchange(gateway.url, [head] + [b" "] * 100, pause_s=0.5)  # 1 byte per 0.5 s
    assert status == 408 and b"request_timeout" in answer
    assert time.monotonic() - start < BODY_TIMEOUT_S + 5
    _still_serving(gateway)


@pytest.mark.parametrize("name", ["x-request-id", "accept"])
def test_non_ascii_forwarded_headers_are_400(gateway, name):
    r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "x"}, headers={name: "caf\u00e9".encode()},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == name
    _still_serving(gateway)


@pytest.mark.parametrize("body", [b"[" * 30000 + b"]" * 30000, b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}"],
                         ids=["array", "in-a-field"])
def test_deeply_nested_json_is_400(gateway, body):
    r = httpx.post(f"{gateway.url}/v1/completions", content=body, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway.url}/admin/replicas", content=body, timeout=30,
                   headers={"Authorization": "Bearer sk-admin"})
    assert r.status_code == 400
    _still_serving(gateway)


def test_all_replicas_down_is_a_503_with_retry_after(tmp_path):
    from tests.server.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", dead, "--probe-interval-s", "0.2",
                        "--breaker-failure-threshold", "1", wait=False)
    try:
        deadline = time.monotonic() + 30
        while (r := httpx.get(f"{gw.url}/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, "the breaker of the dead replica never opened"
            time.sleep(0.2)
        assert r.json()["error"]["code"] == "no_replica_available" and int(r.headers["retry-after"]) >= 1
        r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    finally:
        gw.stop()
