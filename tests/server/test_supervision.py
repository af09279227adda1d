"""A dead engine process is restarted with back-off, and so is one whose step
hangs; past the restart limit the server exits non-zero (docs/SERVING.md,
Failure handling)."""
from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from octavo.engine.fault_injection import ENV as STEP_DELAY_ENV
from octavo.entrypoints.cli import main
from octavo.server import launcher
from tests.server.conftest import ServerProcess
from tests.server.helpers import LONG, SSEStream, wait_for

EXIT_WITHIN_S = 60.0  # generous: the machine may be busy


@pytest.fixture
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("supervision")


def kill_engine_under_a_stream(srv: ServerProcess) -> list[dict]:
    """SIGKILL the engine while a stream is running; the stream's events."""
    stream = SSEStream(srv, LONG)
    stream.start()
    wait_for(lambda: len(stream.lines) >= 2, what="the request to stream")
    os.kill(srv.engine_pid(), signal.SIGKILL)
    stream.join(60)
    assert not stream.is_alive() and stream.status == 200 and stream.lines[-1] == "[DONE]"
    return [json.loads(x) for x in stream.lines[:-1]]


def serves_on_a_new_engine(srv: ServerProcess, first_engine: int) -> dict[str, float]:
    """Once healthy again, another engine process answers; the metrics when idle."""
    srv.wait_healthy(timeout_s=120)
    assert srv.engine_pid() != first_engine
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, headers=srv.headers,
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    return srv.wait_idle()


def test_a_killed_engine_is_restarted_and_past_the_limit_the_server_exits(model_path, logs):
    """One restart allowed in the window: the first death is restarted (its stream fails in band, a request
    meanwhile is refused), the second makes the server exit 1. One server for both: a start costs seconds."""
    srv = ServerProcess(model_path, logs / "restart.log", "--num-blocks", "128", "--engine-max-restarts", "1",
                        "--engine-restart-window", "600")
    try:
        first_engine = srv.engine_pid()
        events = kill_engine_under_a_stream(srv)
        error = events[-1]["error"]  # in-band, then [DONE]
        assert error["code"] == "engine_dead" and "restarting" in error["message"]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers=srv.headers)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"

        metrics = serves_on_a_new_engine(srv, first_engine)
        # The stream that died with the engine failed; the request sent while it was down was refused.
        assert metrics["octavo:engine_restarts_total"] == 1
        assert metrics["octavo:request_errors_total[reason=engine_dead]"] == 1
        assert metrics["octavo:requests_refused_total[reason=engine_dead]"] == 1

        events = kill_engine_under_a_stream(srv)  # the second death in the window
        assert events[-1]["error"]["code"] == "engine_dead"
        assert srv.proc.wait(EXIT_WITHIN_S) == 1
    finally:
        srv.stop()


def test_a_hung_engine_is_restarted(model_path, logs):
    """A step that never returns (the test-only hook makes steps sleep while
    its file exists): past --engine-step-timeout the request gets 503
    engine_hung, the log names what the step held, and a new engine serves.
    Eager steps: on a CPU a first decode of a batch size records a kernel
    tape, a legitimate step of seconds on a busy machine."""
    delay = logs / "step-delay"
    srv = ServerProcess(model_path, logs / "hung.log", "--num-blocks", "128", "--engine-step-timeout", "5",
                        "--enforce-eager", env={STEP_DELAY_ENV: str(delay)})
    try:
        first_engine = srv.engine_pid()
        delay.write_text("3600")
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5},
                       headers=srv.headers, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 503 and error["code"] == "engine_hung" and r.headers["retry-after"] == "1", error
        assert "hung" in error["message"] and "restarting" in error["message"]
        log = srv.log()
        assert "engine step hung" in log and "it holds 1 requests" in log, log
        wait_for(lambda: not os.path.exists(f"/proc/{first_engine}"), what="the hung engine to be killed")

        delay.unlink()
        metrics = serves_on_a_new_engine(srv, first_engine)
        assert metrics["octavo:engine_restarts_total"] == 1
        assert metrics["octavo:request_errors_total[reason=engine_hung]"] == 1
    finally:
        srv.stop()


def test_no_restarts_allowed_exits_at_once(model_path, logs):
    srv = ServerProcess(model_path, logs / "zero.log", "--engine-max-restarts", "0")
    try:
        os.kill(srv.engine_pid(), signal.SIGKILL)
        assert srv.proc.wait(EXIT_WITHIN_S) == 1
        assert "gave up" in srv.log()
    finally:
        srv.stop()


@pytest.mark.parametrize("flag, value, field", [
    ("--engine-max-restarts", "-1", "engine_max_restarts"),
    ("--engine-restart-window", "0", "engine_restart_window_s"),
    ("--request-timeout", "0", "request_timeout_s"),
    ("--engine-step-timeout", "0", "engine_step_timeout_s"),
])
def test_bad_supervision_flags_are_refused_naming_the_field(model_path, flag, value, field, capsys, monkeypatch):
    """`octavo serve`'s own entry point, in this process (a process per flag costs its imports): it exits 2
    naming the field before anything starts serving."""
    def serve(*args: object) -> None:
        raise AssertionError(f"{flag} {value} was not refused: the server started")

    monkeypatch.setattr(launcher, "serve", serve)
    with pytest.raises(SystemExit) as done:
        main(["serve", str(model_path), flag, value])
    assert done.value.code == 2 and field in capsys.readouterr().err
