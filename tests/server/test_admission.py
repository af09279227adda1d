"""Exact admission: a burst never gets more requests in than --max-num-seqs
plus --max-waiting-requests, on any route; the rest get 503 + Retry-After at
once; every place is given back however its request ends, and no KV block
is left behind.

Steps are slowed by the test-only hook (octavo/engine/fault_injection.py)
while a burst arrives, so no admitted request finishes and frees its place
before the last refusal: the count of 200s is then exactly the limit.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path

import httpx
import pytest
from starlette.responses import Response

from octavo.engine.fault_injection import ENV as STEP_DELAY_ENV
from octavo.openai.errors import APIError
from octavo.server.admission import Admission, ReleasingResponse
from tests.server.conftest import ServerProcess

RUNNING, WAITING = 2, 4
LIMIT = RUNNING + WAITING
BURST = 500
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


@pytest.fixture(scope="module")
def delay(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("admission") / "step-delay"


@pytest.fixture(scope="module")
def limited(model_path, delay, tmp_path_factory):
    srv = ServerProcess(
        model_path, tmp_path_factory.mktemp("admission-logs") / "server.log",
        "--num-blocks", "128", "--max-num-seqs", str(RUNNING), "--max-waiting-requests", str(WAITING),
        "--served-model-name", "tiny", "--enforce-eager", api_key=None, env={STEP_DELAY_ENV: str(delay)},
    )
    yield srv
    srv.stop()


def _request(i: int, max_tokens: int) -> tuple[str, dict]:
    """Request i of a burst: each route, streaming or not."""
    path = ROUTES[i % len(ROUTES)]
    stream = bool(i // len(ROUTES) % 2)
    if path == "/v1/responses":
        return path, {"input": f"request {i}", "max_output_tokens": max_tokens, "stream": stream}
    body = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if path == "/v1/chat/completions":
        return path, {**body, "messages": [{"role": "user", "content": f"request {i}"}]}
    return path, {**body, "prompt": f"request {i}"}


async def _burst(srv: ServerProcess, delay: Path, max_tokens: int = 40) -> Counter:
    """BURST requests at once while steps take a second; once every refusal
    is in, steps go back to normal and the admitted ones finish. Outcomes:
    "ok" (a complete answer), "refused" (a proper 503), or what went wrong."""
    delay.write_text("1.0")
    outcomes: Counter = Counter()

    async def one(http: httpx.AsyncClient, i: int) -> None:
        path, body = _request(i, max_tokens)
        async with http.stream("POST", path, json=body) as r:
            text = (await r.aread()).decode()
        if r.status_code == 503:
            good = r.headers.get("retry-after") == "1" and r.json()["error"]["code"] == "overloaded"
            outcomes["refused" if good else f"bad 503: {text[:200]}"] += 1
        elif r.status_code == 200 and (not body["stream"] or "[DONE]" in text or _responses_end(text)):
            outcomes["ok"] += 1
        else:
            outcomes[f"{r.status_code}: {text[:200]}"] += 1

    limits = httpx.Limits(max_connections=BURST)
    async with httpx.AsyncClient(base_url=srv.url, timeout=120.0, limits=limits) as http:
        tasks = [asyncio.create_task(one(http, i)) for i in range(BURST)]
        deadline = asyncio.get_running_loop().time() + 60
        while outcomes["refused"] < BURST - LIMIT and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a refusal past the limit would show up now
        refused_while_slow = outcomes["refused"]
        delay.unlink()
        await asyncio.gather(*tasks)
    assert outcomes["refused"] == refused_while_slow, "a request was refused after the burst"
    return outcomes


def _responses_end(text: str) -> bool:
    return "event: response.completed" in text or "event: response.incomplete" in text


def test_a_burst_admits_exactly_the_limit_on_every_route(limited, delay):
    before = limited.wait_idle()
    outcomes = asyncio.run(_burst(limited, delay))
    assert outcomes == Counter({"ok": LIMIT, "refused": BURST - LIMIT}), outcomes
    after = limited.wait_idle()  # every KV block back in the pool
    key = "octavo:requests_refused_total[reason=queue_full]"
    assert after[key] - before.get(key, 0) == BURST - LIMIT


def test_places_come_back_however_requests_end(limited, delay):
    """Admitted requests that end every other way: the client hangs up while
    queued or mid-stream, the body is bad (400), the task is cancelled. Then
    a burst gets exactly the limit in again: no place was kept."""
    delay.write_text("1.0")

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=limited.url, timeout=120.0) as http:
            async def hang_up(i: int) -> None:
                path, body = _request(i, 40)
                async with http.stream("POST", path, json={**body, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        return  # mid-stream: the first line is enough

            # Streams that start, then hang up; requests still queued when cancelled.
            leavers = [asyncio.create_task(hang_up(i)) for i in range(LIMIT)]
            await asyncio.sleep(3.0)
            for task in leavers:
                task.cancel()
            await asyncio.gather(*leavers, return_exceptions=True)
            await asyncio.sleep(1.0)  # the server sees the connections close
            bad = [http.post("/v1/completions", json={"prompt": "x", "temperature": -1}) for _ in range(20)]
            return [r.status_code for r in await asyncio.gather(*bad)]

    statuses = asyncio.run(run())
    assert set(statuses) <= {400, 503} and 400 in statuses, statuses
    delay.unlink()
    limited.wait_idle()
    outcomes = asyncio.run(_burst(limited, delay))
    assert outcomes == Counter({"ok": LIMIT, "refused": BURST - LIMIT}), outcomes
    limited.wait_idle()


def test_a_reservation_is_all_or_nothing_and_released_once():
    admission = Admission(3)
    first = admission.reserve()
    first.grow(1)
    second = admission.reserve()
    with pytest.raises(APIError) as refused:
        second.grow(1)  # 4 > 3: nothing more taken
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert admission.in_use == 3
    first.release()
    first.release()
    assert admission.in_use == 1
    second.release()
    assert admission.in_use == 0 and Admission(None).reserve().count == 1


@pytest.mark.parametrize("ending", ["sent", "failed", "cancelled"])
def test_a_response_releases_its_places_however_it_ends(ending):
    admission = Admission(1)
    reservation = admission.reserve()

    class Ending(Response):
        async def __call__(self, scope, receive, send) -> None:
            if ending == "failed":
                raise RuntimeError("the stream failed")
            if ending == "cancelled":
                raise asyncio.CancelledError

    async def send(message) -> None:
        pass

    response = ReleasingResponse(Ending(), reservation)
    with pytest.raises((RuntimeError, asyncio.CancelledError)) if ending != "sent" else contextlib.nullcontext():
        asyncio.run(response({"type": "http"}, None, send))
    assert admission.in_use == 0

