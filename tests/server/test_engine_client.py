"""AsyncEngineClient on its own: start-up failures carry the engine's reason; slow consumers cost no queue."""
from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from octavo.config import CacheConfig, EngineConfig, ModelConfig
from octavo.engine.async_client import AsyncEngineClient
from octavo.sampling_params import SamplingParams


def test_start_failure_reports_the_engine_error(model_path, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, broken / name)  # a tokenizer but no weights or config.json
    config = EngineConfig(ModelConfig(str(broken), dtype="float32"))
    # A bad model is the user's to fix: a ValueError naming what is wrong, as the CLI reports it.
    with pytest.raises(ValueError, match=f"no config.json in {broken}"):
        asyncio.run(AsyncEngineClient.start(config, timeout_s=120))


def test_a_consumer_that_falls_behind_gets_one_coalesced_update(model_path):
    """While nobody reads a request's stream, its deltas merge into one
    instead of queueing: after 60+ engine steps unread, the next read returns
    all the tokens since the first read at once."""
    config = EngineConfig(ModelConfig(str(model_path), dtype="float32"), CacheConfig(num_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    async def main() -> tuple[int, list[int]]:
        client = await AsyncEngineClient.start(config, timeout_s=120)
        try:
            stream = client.generate("slow", [5, 6, 7, 8], params)
            first = len((await anext(stream)).outputs[0].token_ids)
            deadline = time.monotonic() + 120
            while client.stats.generation_tokens < 64 or client.stats.num_running:
                assert time.monotonic() < deadline, "the engine did not finish the request"
                await asyncio.sleep(0.05)
            later = [len(out.outputs[0].token_ids) async for out in stream]
            return first, later
        finally:
            await client.shutdown()

    first, later = asyncio.run(main())
    assert first < 64 and later == [64 - first]
