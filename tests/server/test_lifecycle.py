"""Overload (503 + Retry-After) and the graceful SIGTERM drain (a dying
engine process: test_supervision.py)."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from octavo.engine.fault_injection import ENV as STEP_DELAY_ENV
from tests.server.conftest import ServerProcess
from tests.server.helpers import LONG, SSEStream, wait_for


@pytest.fixture(scope="module")
def step_delay(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lifecycle-delay") / "step-delay"


@pytest.fixture(scope="module")
def small_server(model_path, tmp_path_factory, step_delay):
    """One running sequence at a time, at most one request pending; the key comes from $OCTAVO_API_KEY;
    steps slowed on demand (octavo/engine/fault_injection.py)."""
    logs = tmp_path_factory.mktemp("lifecycle")
    args = ("--max-num-seqs", "1", "--max-waiting-requests", "1", "--shutdown-timeout", "20")
    srv = ServerProcess(model_path, logs / "small.log", *args, key_from_env=True, new_session=True,
                        env={STEP_DELAY_ENV: str(step_delay)})
    yield srv
    srv.stop()


def test_overload_503_then_graceful_sigterm(small_server, step_delay):
    srv = small_server
    # Slow steps while the server is full: on a quiet machine the running request could otherwise finish
    # (and free its place) before the third one arrives.
    step_delay.write_text("0.05")
    running = SSEStream(srv, LONG)
    running.start()
    wait_for(lambda: len(running.lines) >= 2, what="the first request to stream")
    queued = SSEStream(srv, {**LONG, "max_tokens": 5})
    queued.start()
    wait_for(lambda: srv.metrics()["octavo:num_requests_waiting"] == 1, what="the second request to wait")

    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=srv.headers)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"
    step_delay.unlink()  # the drain below at full speed

    # SIGTERM to the whole process group (as systemd, `timeout` or a shell's
    # job control send it) while both are in flight: the engine ignores it
    # and keeps serving the drain, they finish, new connections are refused,
    # the process exits 0.
    engine = Path(f"/proc/{srv.engine_pid()}")
    os.killpg(srv.proc.pid, signal.SIGTERM)
    wait_for(lambda: _refused(srv.url), what="the listener to close")
    running.join(60)
    queued.join(60)
    assert running.status == 200 and running.lines[-1] == "[DONE]" and running.error is None
    assert json.loads(running.lines[-2])["choices"][0]["finish_reason"] == "length"
    assert queued.lines[-1] == "[DONE]" and queued.error is None
    assert srv.proc.wait(30) == 0
    wait_for(lambda: not engine.exists(), what="the engine process to exit")
    assert "engine process exited" not in srv.log()


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1.0)
    except httpx.ConnectError:
        return True
    return False

