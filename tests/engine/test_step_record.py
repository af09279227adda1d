"""--step-record: the engine process appends one line per step, holding the work the scheduler gave it."""
from __future__ import annotations

import asyncio
import json

import pytest

from octavo.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from octavo.engine.async_client import AsyncEngineClient
from octavo.sampling_params import SamplingParams

PROMPT, OUTPUT = [5, 6, 7, 8, 9], 6


def test_every_step_is_recorded_with_its_work(folder, tmp_path):
    path = tmp_path / "steps.jsonl"
    config = EngineConfig(ModelConfig(str(folder), dtype="float32"), CacheConfig(num_blocks=64),
                          SchedulerConfig(step_record=str(path)))
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)

    async def main() -> list[int]:
        client = await AsyncEngineClient.start(config, timeout_s=120)
        try:
            outs = [out async for out in client.generate("a", PROMPT, params)]
            return [t for out in outs for t in out.outputs[0].token_ids]
        finally:
            await client.shutdown()

    tokens = asyncio.run(main())
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    # One prompt step, then one decode step per further token, each one request's triple.
    assert len(tokens) == OUTPUT and len(steps) == OUTPUT
    assert steps[0]["scheduled"] == [[len(PROMPT), 0, 1]] and steps[0]["after_idle"]
    assert [s["scheduled"] for s in steps[1:]] == [[[1, len(PROMPT) + i, 1]] for i in range(OUTPUT - 1)]
    assert not any(s["after_idle"] for s in steps[1:])
    starts = [s["start"] for s in steps]
    assert starts == sorted(starts) and all(s["seconds"] > 0 for s in steps)
    # Back to back: each step starts after the last one ended.
    assert all(b["start"] >= a["start"] + a["seconds"] for a, b in zip(steps, steps[1:]))


def test_a_step_record_in_a_missing_folder_is_refused_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match="step_record"):
        SchedulerConfig(step_record=str(tmp_path / "absent" / "steps.jsonl"))
