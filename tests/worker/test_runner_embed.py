"""A runner of an embedding model: asking it for logits is a clear error."""
from __future__ import annotations

import pytest

from tests.model_factory import make_tiny_model

from .runner_utils import Blocks, make_request, make_runner, step


def test_execute_logits_on_an_embedding_model_names_the_task(tmp_path):
    runner = make_runner(make_tiny_model(tmp_path, "qwen3", headless=True))
    blocks = Blocks(runner)
    req = make_request("a", [5, 6, 7, 8])
    with pytest.raises(ValueError, match="task 'embed'"):
        runner.execute_logits(step(blocks.chunk(req, 0, 4, sample=False)))
