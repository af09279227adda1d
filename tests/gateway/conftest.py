"""Real `octavo serve` replicas and `octavo gateway` processes on loopback ports."""
from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.model_factory import make_tiny_model
from tests.server.conftest import REPO, ServerProcess, free_port, stop_all, wait_all_healthy

ADMIN_KEY = "sk-admin"


class GatewayProcess:
    """One `python -m octavo.entrypoints.cli gateway ...` child process."""

    def __init__(self, log_path: Path, *args: str, api_key: Optional[str] = None, admin_key: str = ADMIN_KEY,
                 wait: bool = True) -> None:
        """``wait``: until /health says a replica is routable (else until it answers at all)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "gateway", "--port", str(self.port),
               "--log-level", "warning", "--admin-key", admin_key, *args]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_up(healthy=wait)

    def _wait_up(self, healthy: bool, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200 or not healthy:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gateway did not become healthy:\n{self.log()}")

    def openai(self, api_key: Optional[str] = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "none",
                             max_retries=0, timeout=120.0)

    def admin(self, method: str, body: Optional[dict] = None) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin/replicas", json=body,
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10.0)

    def breaker(self, replica_url: str) -> str:
        return next(r["breaker"] for r in self.admin("GET").json()["replicas"] if r["url"] == replica_url)

    def metrics(self) -> dict[str, float]:
        """Sample name with its labels -> value."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10.0).text):
            for s in family.samples:
                values[s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()))] = s.value
        return values

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class EchoUpstream:
    """tests/gateway/echo_upstream.py under uvicorn; ``overloaded``: every completion is a full queue's 503."""

    def __init__(self, log_path: Path, overloaded: bool = False, port: Optional[int] = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "ECHO_OVERLOADED": "1" if overloaded else "0"}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "tests.gateway.echo_upstream:app", "--port", str(self.port),
             "--log-level", "warning"], cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"echo upstream did not start: see {log_path}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture
def echo(tmp_path):
    upstream = EchoUpstream(tmp_path / "echo.log")
    yield upstream.url
    upstream.stop()


def raw_exchange(url: str, chunks: list[bytes], pause_s: float = 0.0, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """Sends ``chunks`` over one raw connection, ``pause_s`` apart (what no
    well-behaved client library sends: malformed or slow requests), stopping
    early once the server answers, and returns the response's status and text."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        for i, chunk in enumerate(chunks):
            if i and select.select([sock], [], [], pause_s)[0]:
                break  # the server answered before the request was whole
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        received = b""
        while not _whole(received):
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/") else 0
    return status, received


def _whole(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


class RedisProcess:
    """A throwaway redis-server on a free loopback port, no persistence."""

    def __init__(self, log_path: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian package redis-server; .ci/run installs it)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        import redis

        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gateway-model"))


def start_replica(model_path: Path, log_dir: Path, name: str, *args: str, port: Optional[int] = None,
                  wait: bool = True) -> ServerProcess:
    return ServerProcess(model_path, log_dir / f"{name}.log", "--num-blocks", "256", "--served-model-name", "tiny",
                         *args, api_key=None, port=port, wait=wait)


@pytest.fixture(scope="session")
def replicas(model_path, tmp_path_factory):
    """Three replicas of one model, shared by the tests that leave them running."""
    log_dir = tmp_path_factory.mktemp("replica-logs")
    procs = wait_all_healthy([start_replica(model_path, log_dir, f"replica{i}", wait=False) for i in range(3)])
    yield procs
    stop_all(procs)
