"""Priority classes: a key's class becomes the engine's ``priority`` field of every request it sends."""
from __future__ import annotations

import json

import httpx

from tests.gateway.conftest import GatewayProcess


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
