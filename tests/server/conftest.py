"""Real `octavo serve` processes on free localhost ports, over a tiny random model."""
from __future__ import annotations

import os
import resource
import signal
import socket
import ssl
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

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limit_address_space(limit_bytes: int) -> None:
    """In the child before exec; the engine process inherits it. A request
    that makes the server allocate without bound then fails with MemoryError
    there instead of driving the shared test machine into the OOM killer."""
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


class ServerProcess:
    """One `python -m octavo.entrypoints.cli serve ...` child process."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        *args: str,
        api_key: Optional[str] = API_KEY,
        key_from_env: bool = False,
        wait: bool = True,
        memory_limit: Optional[int] = None,
        new_session: bool = False,
        tls: Optional[ssl.SSLContext] = None,
        port: Optional[int] = None,
        env: Optional[dict[str, str]] = None,
    ) -> None:
        """``tls``: the server speaks HTTPS (its --ssl-* args are the caller's); clients trust this context.
        ``port``: a given port, for a restart at the same address. ``env``: more environment variables."""
        self.port = port or free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", str(model), "--port", str(self.port)]
        cmd += ["--dtype", "float32", "--log-level", "warning", *args]
        extra_env = env or {}
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.pop("OCTAVO_API_KEY", None)
        env.update(extra_env)
        if api_key is not None and key_from_env:
            env["OCTAVO_API_KEY"] = api_key
        elif api_key is not None:
            cmd += ["--api-key", api_key]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self._terminated = False
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=None if memory_limit is None else lambda: _limit_address_space(memory_limit),
            start_new_session=new_session,  # its own process group, for signals sent to the group
        )
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0, verify=self.tls or True).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60.0, verify=self.tls or True, **kw)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=60.0,
                             http_client=httpx.Client(verify=self.tls or True))

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=120.0)

    def metrics(self) -> dict[str, float]:
        """Sample name (labels dropped) -> value; every sample here has one model_name label."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                key = sample.name + "".join(f"[{k}={v}]" for k, v in sorted(labels.items()))
                values[key] = sample.value
        return values

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Metrics once the engine runs nothing and every KV block is free again."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
            if idle and m["octavo:kv_free_blocks"] == m["octavo:kv_total_blocks"]:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: {m}")
            time.sleep(0.1)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def engine_pid(self) -> int:
        """The spawned engine process among the server's children."""
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline:
                    return int(pid)
        raise AssertionError("no engine child process")

    def terminate(self) -> None:
        """SIGTERM, once (a second one would cut the drain short); ``stop`` waits for the exit."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def wait_all_healthy(servers: list[ServerProcess]) -> list[ServerProcess]:
    """Servers started with ``wait=False``, once each answers: they load side by side (a start is
    mostly one core's imports and model load), so several cost little more than one. One that
    fails stops them all."""
    try:
        for srv in servers:
            srv.wait_healthy()
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: list[ServerProcess]) -> None:
    """Every server told to stop first, then each waited for: they drain and exit side by side."""
    for srv in servers:
        srv.terminate()
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("server-model"))


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory):
    """The shared server: API key on, a KV pool big enough for 64 streams."""
    srv = ServerProcess(
        model_path,
        tmp_path_factory.mktemp("logs") / "server.log",
        "--num-blocks", "512",
        "--max-num-seqs", "64",
        "--max-body-size", "64KiB",
        "--served-model-name", "tiny",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def offline_llm(model_path):
    from octavo import LLM

    return LLM(model_path, dtype="float32", num_blocks=512)


@pytest.fixture(scope="session")
def tuned_server(model_path, tmp_path_factory):
    """A second server with the opt-in and tuned options: request chat
    templates trusted, unknown request fields refused, small request limits
    (set through the generated --max-* flags), a body limit big enough for
    multi-megabyte prompts."""
    srv = ServerProcess(
        model_path,
        tmp_path_factory.mktemp("logs") / "tuned.log",
        "--num-blocks", "256",
        "--served-model-name", "tiny",
        "--max-body-size", "16MiB",
        "--trust-request-chat-template",
        "--strict-request-fields",
        "--max-template-seconds", "1.5",
        "--max-n", "4",
        "--max-schema-bytes", "2000",
        api_key=None,
    )
    yield srv
    srv.stop()
