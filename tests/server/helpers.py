"""Helpers for tests that watch a server over time: polling, background SSE streams."""
from __future__ import annotations

import threading
import time
from typing import Callable

import httpx

from tests.server.conftest import ServerProcess

LONG = {"prompt": "Once upon a time", "max_tokens": 450, "temperature": 0, "ignore_eos": True}


def wait_for(pred: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class SSEStream(threading.Thread):
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
