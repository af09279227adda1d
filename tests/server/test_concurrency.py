"""Many simultaneous streams, and clients that hang up: the engine frees their KV blocks."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from octavo import SamplingParams

MODEL = "tiny"


def test_64_concurrent_streams_equal_offline(server, offline_llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 512) for _ in range(rng.randrange(3, 40))] for _ in range(64)]
    lengths = [rng.randrange(4, 24) for _ in range(64)]

    async def one(client, prompt, max_tokens):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        client = server.async_openai()
        try:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    refs = offline_llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths], use_tqdm=False
    )
    assert [r[0] for r in results] == [ref.outputs[0].text for ref in refs]
    assert [r[1] for r in results] == [ref.outputs[0].finish_reason for ref in refs]
    server.wait_idle()


def _busy_kv(server, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metrics()["octavo:kv_free_blocks"] == server.metrics()["octavo:kv_total_blocks"]:
        assert time.monotonic() < deadline, "the request never took KV blocks"
        time.sleep(0.05)


def test_disconnect_mid_stream_aborts(server):
    idle = server.wait_idle()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30.0) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert first["choices"][0]["text"] is not None
            _busy_kv(server)
        # Leaving the block closes the connection mid-stream.
    after = server.wait_idle()
    key = "octavo:request_success_total[finished_reason=abort]"
    assert after.get(key, 0) == idle.get(key, 0) + 1
    assert after["octavo:generation_tokens_total"] - idle["octavo:generation_tokens_total"] < 400


def test_disconnect_non_streaming_aborts(server):
    idle = server.wait_idle()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long story"}], "max_tokens": 480,
            "ignore_eos": True, "temperature": 0}
    # Give up after 0.1 s: the tiny model writes all 480 tokens in well under a second.
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=httpx.Timeout(30.0, read=0.1)) as http:
        try:
            http.post("/v1/chat/completions", json=body)
        except httpx.ReadTimeout:
            pass  # gave up waiting: the client closes the connection
    after = server.wait_idle()
    assert after["octavo:generation_tokens_total"] - idle["octavo:generation_tokens_total"] < 480
    key = "octavo:request_success_total[finished_reason=abort]"
    assert after.get(key, 0) == idle.get(key, 0) + 1


def test_disconnect_storm_frees_every_block(server):
    """Many clients hang up at once: mid-stream, mid-generation without a
    stream, and right after sending. Afterwards nothing runs, every KV block
    is free, and the server still answers."""
    idle = server.wait_idle()
    num_clients, max_tokens = 24, 300  # 24 x 20 blocks fit the 512-block pool: no preemption muddles the count
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    async def mid_stream(http: httpx.AsyncClient, i: int) -> None:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen > i % 4:
                    return  # leaving the block closes the connection

    async def give_up_after(http: httpx.AsyncClient, seconds: float) -> None:
        try:
            await http.post("/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=seconds))
        except httpx.ReadTimeout:
            pass

    async def storm() -> None:
        limits = httpx.Limits(max_connections=num_clients)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=30.0, limits=limits) as http:
            jobs = []
            for i in range(num_clients):
                kind = i % 3
                if kind == 0:
                    jobs.append(mid_stream(http, i))
                else:
                    jobs.append(give_up_after(http, 0.2 if kind == 1 else 0.005))
            await asyncio.gather(*jobs)

    asyncio.run(storm())
    after = server.wait_idle(timeout_s=60)
    aborted = after.get("octavo:request_success_total[finished_reason=abort]", 0) - idle.get(
        "octavo:request_success_total[finished_reason=abort]", 0)
    # Every streaming client left after at most 4 events of 300: aborted, surely.
    # A client gone within 5 ms may be dropped before its request reaches the engine.
    assert num_clients // 3 <= aborted <= num_clients
    assert after["octavo:generation_tokens_total"] - idle["octavo:generation_tokens_total"] < num_clients * max_tokens
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
