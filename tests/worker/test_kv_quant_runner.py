"""A quantized KV cache (int8, fp8) against the bf16 cache it replaces, on
the tiny models of every architecture: the same steps (a fresh prefill chunk,
a chunk over the cached prefix, decodes read in place by the native kernel
or gathered by torch) give logits within a bound of the bf16 cache's.

Bound, as a fraction of the logits' standard deviation (~0.8 here): int8
0.15, fp8 0.5. Measured (60 positions, every variant and backend): int8 at
most 0.09 (max abs diff 0.07), fp8 at most 0.38 (0.30): e4m3 keeps 3
mantissa bits, a relative step of up to 1/16 per element against int8's
1/254 of the row's largest."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import VARIANTS

from .runner_utils import Blocks, make_request, make_runner, step

BOUND = {"int8": 0.15, "fp8": 0.5}
BACKENDS = {"native": {"attention_backend": "native", "fused_ops": True},
            "torch": {"attention_backend": "torch", "fused_ops": False}}


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(5, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits(folder, kv_cache_dtype: str, backend: str, tokens: list[int]) -> torch.Tensor:
    """Logits of every position: 20 prompt tokens fresh, 10 over the cached 20, then decodes."""
    runner = make_runner(folder, block_size=16, num_blocks=16, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                         **BACKENDS[backend])
    blocks = Blocks(runner)
    req = make_request("a", tokens[:30])
    parts = [runner.execute_logits(step(blocks.chunk(req, 0, 20, sample=False)))["a"],
             runner.execute_logits(step(blocks.chunk(req, 20, 10)))["a"]]
    for t in tokens[30:]:
        req.append_output_token(t)
        parts.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    return torch.cat(parts)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_close_to_the_bf16_cache(name, kv, backend, variant):
    tokens = _tokens(60, seed=1)
    ref = _logits(variant(name), "auto", backend, tokens)
    ours = _logits(variant(name), kv, backend, tokens)
    assert ours.shape == ref.shape == (60, 512)
    diff = (ours - ref).abs().max().item()
    assert diff < BOUND[kv] * ref.std().item(), f"max abs diff {diff}, logit std {ref.std().item()}"
