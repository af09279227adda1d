"""`octavo serve` with KV tiers: prompts the pool evicted come back from host
memory with the same completion, the hits and the bytes held show on
/metrics by medium, and a server stopped and started again on the same
--kv-offload-dir answers a returning prompt from disk."""
from __future__ import annotations

import httpx

from tests.engine.conftest import random_prompts
from tests.server.conftest import ServerProcess

# A pool of 8 blocks of 16 tokens; each prompt fills 4 full blocks.
PROMPTS = random_prompts([70, 72, 74], seed=9)


def _complete(srv: ServerProcess, prompt: list[int]) -> str:
    r = httpx.post(srv.url + "/v1/completions", headers=srv.headers, timeout=120,
                   json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_tiers_serve_evicted_prompts_and_survive_a_restart(model_path, tmp_path):
    folder = tmp_path / "kv"
    args = ("--num-blocks", "8", "--max-model-len", "128", "--kv-offload-host-bytes", "64KiB",
            "--kv-offload-dir", str(folder), "--kv-offload-disk-bytes", "1MiB")
    srv = ServerProcess(model_path, tmp_path / "first.log", *args)
    try:
        before = srv.wait_idle()
        texts = [_complete(srv, p) for p in PROMPTS]
        assert _complete(srv, PROMPTS[0]) == texts[0]  # evicted by the two after it
        after = srv.wait_idle()
        hits = after['octavo:kv_offload_hits_total[medium=cpu]'] - before['octavo:kv_offload_hits_total[medium=cpu]']
        assert hits == 64
        assert after["octavo:kv_offload_bytes[medium=cpu]"] > 0
        assert after["octavo:kv_offload_hits_total[medium=disk]"] == 0
    finally:
        assert srv.stop() == 0
    srv = ServerProcess(model_path, tmp_path / "second.log", *args)
    try:
        assert _complete(srv, PROMPTS[1]) == texts[1]
        after = srv.wait_idle()
        assert after["octavo:kv_offload_hits_total[medium=disk]"] == 64
        assert after["octavo:prefix_cache_hits_total"] == 64
        assert after["octavo:kv_offload_errors_total[op=read]"] == 0
        assert after["octavo:kv_offload_errors_total[op=write]"] == 0
    finally:
        srv.stop()
