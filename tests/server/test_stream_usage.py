"""stream_options.continuous_usage_stats (vLLM's; guidellm sends it): every chunk carries the usage so far."""
from __future__ import annotations

import json

import pytest


def _chunks(server, path: str, body: dict) -> list[dict]:
    with server.http() as http, http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "The rain"}),
])
def test_every_chunk_carries_the_usage_so_far(server, path, body):
    body = {**body, "model": "tiny", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    continuous = _chunks(server, path, {**body, "stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in continuous)
    counts = [c["usage"]["completion_tokens"] for c in continuous]
    assert counts == sorted(counts) and counts[-1] == 5
    prompt = {c["usage"]["prompt_tokens"] for c in continuous}
    assert len(prompt) == 1 and all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"]
                                    + c["usage"]["completion_tokens"] for c in continuous)
    # The final usage-only chunk is the one include_usage alone sends.
    final_only = _chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    assert [c["usage"] for c in final_only if c["usage"] is not None] == [continuous[-1]["usage"]]
    assert continuous[-1]["choices"] == [] and final_only[-1]["choices"] == []
