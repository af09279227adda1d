"""--shed-waiting reads the queue of this moment: waves of mixed priorities arrive faster than the engine's
stats are refreshed, and no low-priority request is let in while the queue is at the limit.

Steps are slowed by the test-only hook (octavo/engine/fault_injection.py), so the urgent requests of each
wave hold the batch and the queue while the low-priority ones arrive."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from octavo.engine.fault_injection import ENV as STEP_DELAY_ENV
from octavo.engine.stats import EngineStats
from octavo.openai.errors import APIError
from octavo.server.admission import Admission
from octavo.server.shedding import ShedConfig, check_shedding
from tests.server.conftest import ServerProcess

RUNNING, SHED_WAITING = 2, 2


def test_the_front_s_own_count_sheds_before_the_engine_s_snapshot_does():
    config = ShedConfig(shed_waiting=SHED_WAITING, shed_min_priority=1)
    stale = EngineStats(num_total_blocks=100, num_free_blocks=100, num_waiting=0)
    admission = Admission(None, batch=RUNNING)
    held = [admission.reserve() for _ in range(RUNNING + SHED_WAITING)]  # the batch full, two waiting
    late = admission.reserve()
    assert admission.waiting_besides(late) == SHED_WAITING
    with pytest.raises(APIError) as info:
        check_shedding(config, stale, 1, admission.waiting_besides(late))
    assert info.value.code == "shed_low_priority" and "2 requests queued" in info.value.message
    check_shedding(config, stale, 0, admission.waiting_besides(late))  # urgent: admitted
    for reservation in held[:2]:
        reservation.release()
    check_shedding(config, stale, 1, admission.waiting_besides(late))  # the queue drained
    assert Admission(None).waiting_besides(late) == 0  # no batch known: the engine's count alone


@pytest.fixture(scope="module")
def delay(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shedding") / "step-delay"


@pytest.fixture(scope="module")
def shedding(model_path, delay, tmp_path_factory):
    srv = ServerProcess(
        model_path, tmp_path_factory.mktemp("shedding-logs") / "server.log", "--num-blocks", "128",
        "--max-num-seqs", str(RUNNING), "--shed-waiting", str(SHED_WAITING), "--shed-min-priority", "1",
        "--enforce-eager", api_key=None, env={STEP_DELAY_ENV: str(delay)},
    )
    yield srv
    srv.stop()


async def _wave(srv: ServerProcess, delay: Path, wave: int) -> list[tuple[int, int]]:
    """Four urgent streams (two run, two wait), then eight low-priority requests at once: (priority, status)."""
    delay.write_text("0.5")
    results: list[tuple[int, int]] = []
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
        async def one(priority: int, i: int) -> None:
            body = {"prompt": f"wave {wave} request {i}", "max_tokens": 8, "ignore_eos": True, "priority": priority}
            r = await http.post("/v1/completions", json=body)
            results.append((priority, r.status_code))

        urgent = [asyncio.create_task(one(0, i)) for i in range(RUNNING + SHED_WAITING)]
        await asyncio.sleep(0.3)  # the urgent ones are in; the engine's snapshot may still say otherwise
        low = [asyncio.create_task(one(3, i)) for i in range(8)]
        await asyncio.gather(*low)
        delay.unlink()
        await asyncio.gather(*urgent)
    return results


def test_no_low_priority_request_gets_in_while_the_queue_is_at_the_limit(shedding, delay):
    for wave in range(3):
        results = asyncio.run(_wave(shedding, delay, wave))
        assert sorted(status for priority, status in results if priority == 0) == [200] * (RUNNING + SHED_WAITING)
        assert [status for priority, status in results if priority == 3] == [503] * 8, (wave, results)
        shedding.wait_idle()  # every KV block back in the pool
