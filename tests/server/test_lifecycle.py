"""Overload (503 + Retry-After), graceful SIGTERM drain, and a dying engine process."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess

LONG = {"prompt": "Once upon a time", "max_tokens": 450, "temperature": 0, "ignore_eos": True}


def _wait_for(pred, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _Stream(threading.Thread):
    """A streaming completion read in the background; keeps every SSE data line."""

    def __init__(self, srv: ServerProcess, body: dict) -> None:
        super().__init__(daemon=True)
        self.srv, self.body = srv, {**body, "stream": True}
        self.lines: list[str] = []
        self.status = None
        self.error = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.srv.url + "/v1/completions", json=self.body,
                              headers=self.srv.headers, timeout=60.0) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
        except httpx.HTTPError as exc:
            self.error = exc


@pytest.fixture(scope="module")
def small_servers(model_path, tmp_path_factory):
    """Two servers (started together to save time), one per test: one running
    sequence at a time, at most one request pending; the key comes from $OCTAVO_API_KEY."""
    logs = tmp_path_factory.mktemp("lifecycle")
    args = ("--max-num-seqs", "1", "--max-waiting-requests", "1", "--shutdown-timeout", "20")
    servers = [ServerProcess(model_path, logs / f"small{i}.log", *args, key_from_env=True, wait=False) for i in range(2)]
    try:
        for srv in servers:
            srv.wait_healthy()
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def test_overload_503_then_graceful_sigterm(small_servers):
    srv = small_servers[0]
    running = _Stream(srv, LONG)
    running.start()
    _wait_for(lambda: len(running.lines) >= 2, what="the first request to stream")
    queued = _Stream(srv, {**LONG, "max_tokens": 5})
    queued.start()
    _wait_for(lambda: srv.metrics()["octavo:num_requests_waiting"] == 1, what="the second request to wait")

    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=srv.headers)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"

    # SIGTERM while both are in flight: they finish, new connections are refused, the process exits 0.
    engine = Path(f"/proc/{srv.engine_pid()}")
    srv.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: _refused(srv.url), what="the listener to close")
    running.join(60)
    queued.join(60)
    assert running.status == 200 and running.lines[-1] == "[DONE]" and running.error is None
    assert json.loads(running.lines[-2])["choices"][0]["finish_reason"] == "length"
    assert queued.lines[-1] == "[DONE]" and queued.error is None
    assert srv.proc.wait(30) == 0
    _wait_for(lambda: not engine.exists(), what="the engine process to exit")


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1.0)
    except httpx.ConnectError:
        return True
    return False


def test_engine_death_is_detected(small_servers):
    srv = small_servers[1]
    stream = _Stream(srv, LONG)
    stream.start()
    _wait_for(lambda: len(stream.lines) >= 2, what="the request to stream")
    os.kill(srv.engine_pid(), signal.SIGKILL)
    stream.join(30)
    assert not stream.is_alive()
    events = [json.loads(x) for x in stream.lines if x != "[DONE]"]
    assert events[-1]["error"]["code"] == "engine_dead"  # in-band error, then [DONE]
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers=srv.headers)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
