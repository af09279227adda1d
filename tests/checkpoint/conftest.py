from __future__ import annotations

import random

import pytest
import torch

from tests.worker.runner_utils import Blocks, make_request, make_runner, step

PROMPT = [random.Random(7).randrange(5, 512) for _ in range(24)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: a second intra-op thread only slows them down on busy shared cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def octavo_logits(model, prompt=PROMPT, decode=(7, 99), dtype="float32", **kwargs) -> tuple[torch.Tensor, list[int]]:
    """Octavo's logits at every prompt position (one prefill) and after each
    of ``decode`` (one decode step each), with the token ids they score."""
    runner = make_runner(model, dtype=dtype, **kwargs)
    blocks = Blocks(runner)
    req = make_request("a", list(prompt))
    got = [runner.execute_logits(step(blocks.chunk(req, 0, len(prompt))))["a"]]
    for token in decode:
        req.append_output_token(token)
        got.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    return torch.cat(got), req.all_token_ids
