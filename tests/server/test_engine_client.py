"""AsyncEngineClient on its own: start-up failures carry the engine's reason."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from octavo.config import EngineConfig, ModelConfig
from octavo.engine.async_client import AsyncEngineClient, EngineDeadError


def test_start_failure_reports_the_engine_error(model_path, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, broken / name)  # a tokenizer but no weights or config.json
    config = EngineConfig(ModelConfig(str(broken), dtype="float32"))
    with pytest.raises(EngineDeadError) as exc:
        asyncio.run(AsyncEngineClient.start(config, timeout_s=120))
    message = str(exc.value)
    assert "engine failed to start" in message and "ValueError" in message
