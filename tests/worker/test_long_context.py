"""A prompt far longer than the chunk: 2048 tokens in chunks of 128, each chunk reading the cached
context in several tiles, on a tiny Qwen2 whose 2048-token context comes from YaRN over the 512 its
config names (Qwen2.5's 128k set-up, scaled down): every position's logits equal transformers'."""
from __future__ import annotations

import torch

from octavo.attention import prefill
from tests.model_factory import load_hf_model, make_tiny_model

from .runner_utils import Blocks, hf_logits, make_request, make_runner, step

CONTEXT, CHUNK = 2048, 128


def test_a_long_prompt_in_many_chunks_matches_transformers(tmp_path, monkeypatch):
    # Tiles of 512 keys: the last chunks merge four.
    monkeypatch.setattr(prefill, "KEY_TILE", 512)
    folder = make_tiny_model(tmp_path, "qwen2", max_position_embeddings=512, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 10000.0})
    runner = make_runner(folder, num_blocks=CONTEXT // 16)
    assert runner.max_model_len == CONTEXT  # beyond max_position_embeddings, as the YaRN factor allows
    prompt = torch.randint(5, 512, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    req = make_request("a", prompt)
    blocks = Blocks(runner)
    ours = torch.cat([
        runner.execute_logits(step(blocks.chunk(req, start, CHUNK, sample=False)))["a"]
        for start in range(0, CONTEXT, CHUNK)
    ])
    ref = hf_logits(load_hf_model(folder), prompt)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4
