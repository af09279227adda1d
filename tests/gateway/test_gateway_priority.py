"""Priority classes: a key's class becomes the engine's ``priority`` field of every request it sends."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.gateway.conftest import GatewayProcess
from tests.server.conftest import REPO, free_port


@pytest.fixture
def echo(tmp_path):
    port = free_port()
    log = open(tmp_path / "echo.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.gateway.echo_upstream:app", "--port", str(port),
                             "--log-level", "warning"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_priority_class_per_key(echo, tmp_path):
    config = tmp_path / "g.yaml"
    config.write_text("keys:\n  - {key: sk-interactive, priority: -1}\n  - {key: sk-batch, priority: 10}\n")
    gw = GatewayProcess(tmp_path / "gw.log", "--replica", echo, "--config", str(config), "--no-cache")
    try:
        def sent(key: str, body: dict) -> dict:
            r = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                           timeout=30)
            assert r.status_code == 200, r.text
            return json.loads(r.json()["choices"][0]["text"])

        assert sent("sk-interactive", {"prompt": "x"})["priority"] == -1
        # The key decides, not the body: batch traffic cannot jump the queue.
        assert sent("sk-batch", {"prompt": "x", "priority": -5})["priority"] == 10
        assert sent("sk-batch", {"prompt": "x", "max_tokens": 3}) == {"prompt": "x", "max_tokens": 3, "priority": 10}
    finally:
        gw.stop()
