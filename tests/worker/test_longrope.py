"""Phi-3.5 / Phi-4-mini's LongRoPE on both sides of the trained context.

transformers picks the short or the long factors per forward pass, by its
longest position; the engine picks once, by max_model_len (positions then
mean the same in every batch: octavo/model/layers/rotary.py). The two agree
for a sequence scored in one pass: short factors for an engine held within
the trained 64 positions, long ones beyond, where a prompt longer than 64
gets the long factors in transformers too. Partial rotary (12 of 16 dims)
and tied embeddings as Phi-4-mini has them."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts
from tests.model_factory import load_hf_model, make_tiny_model

from .runner_utils import Blocks, hf_logits, make_request, make_runner, step

ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.4, 1.8, 2.2, 2.5], "long_factor": [1.5, 3.0, 6.0, 10.0, 16.0, 24.0]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("longrope"), "phi3", tie_word_embeddings=True,
                           original_max_position_embeddings=64, rope_parameters=ROPE)


@pytest.fixture(scope="module")
def hf(folder):
    return load_hf_model(folder)


def _logits(folder, prompt: list[int], **model_kwargs) -> torch.Tensor:
    """A prefill chunk, a chunk over the cached first one, then decodes."""
    runner = make_runner(folder, **model_kwargs)
    blocks = Blocks(runner)
    req = make_request("a", prompt[: len(prompt) - 4])
    cut = len(prompt) // 2
    parts = [runner.execute_logits(step(blocks.chunk(req, 0, cut, sample=False)))["a"],
             runner.execute_logits(step(blocks.chunk(req, cut, req.num_tokens - cut)))["a"]]
    for t in prompt[-4:]:
        req.append_output_token(t)
        parts.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    return torch.cat(parts)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_long_factors_beyond_the_trained_context(folder, hf, backend):
    prompt = random_prompts([100], seed=4)[0]
    ours = _logits(folder, prompt, attention_backend=backend)
    diff = (ours - hf_logits(hf, prompt)).abs().max().item()
    assert diff < 1e-4, f"max abs diff {diff}"


def test_short_factors_within_it(folder, hf):
    prompt = random_prompts([60], seed=5)[0]
    ours = _logits(folder, prompt, max_model_len=64)
    ref = hf_logits(hf, prompt)
    assert (ours - ref).abs().max().item() < 1e-4
    # The long factors give other numbers: the choice is really made.
    assert (_logits(folder, prompt) - ref).abs().max().item() > 1e-2


def test_greedy_batch_beyond_the_trained_context(folder):
    prompts = random_prompts([70, 90, 65], seed=6)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=48)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts, 16)
