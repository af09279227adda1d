"""Adding an attention backend with a cache layout of its own: a file with the backend and one
``register_attention_backend`` call.

The toy keeps each layer's cache head-major, ``[2, blocks, kv_heads, block_size, head_dim]`` (the
layout FlashInfer calls HND), allocates it from the layer's KVCacheSpec, writes K/V itself and
attends with plain torch ops, one request at a time. The engine serves a model with it, sliding
windows, chunked prefill and prefix sharing included, and its greedy tokens and log-probabilities
match the built-in torch backend's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterable, Optional

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.kv_spec import KVCacheSpec
from octavo.attention.registry import ATTENTION_BACKENDS, register_attention_backend
from tests.model_factory import make_variant

_FLOATS = (torch.float32, torch.bfloat16)


@dataclass
class HeadMajorMetadata(AttentionMetadata):
    layout: StepLayout


class HeadMajorBackend(AttentionBackend):
    name = "toy_head_major"
    requirement = "keeps float caches"
    cache_layout: ClassVar[str] = "[2, blocks, kv_heads, block_size, head_dim]"

    def __init__(self, windows: Iterable[Optional[int]]) -> None:
        super().__init__(windows)

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        return cache_dtype in _FLOATS

    def allocate_cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                       static_scales: Optional[torch.Tensor] = None) -> LayerKVCache:
        return LayerKVCache(torch.zeros(2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim,
                                        dtype=spec.dtype, device=device))

    def build_metadata(self, layout: StepLayout) -> HeadMajorMetadata:
        return HeadMajorMetadata(layout.slot_mapping, layout.num_decodes, [], layout)

    def write_kv(self, kv_cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        block_size = kv_cache.data.shape[3]
        block, offset = meta.slot_mapping // block_size, meta.slot_mapping % block_size
        kv_cache.data[0, block, :, offset] = k.to(kv_cache.dtype)
        kv_cache.data[1, block, :, offset] = v.to(kv_cache.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache,
                meta: HeadMajorMetadata, window: Optional[int], scale: Optional[float] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        layout, out = meta.layout, torch.empty_like(q)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        for i, (start, length, context) in enumerate(zip(layout.query_starts, layout.query_lens, layout.context_lens)):
            blocks = layout.block_table[i, : layout.blocks_needed[i]]
            # [kv_heads, positions, head_dim], this request's context only.
            keys, values = (kv_cache.data[j, blocks].transpose(0, 1).flatten(1, 2)[:, :context].float()
                            for j in (0, 1))
            group = q.shape[1] // keys.shape[0]
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
            queries = q[start : start + length].transpose(0, 1).float()  # [heads, length, head_dim]
            scores = queries @ keys.transpose(1, 2) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            query_pos = torch.arange(context - length, context).unsqueeze(1)
            key_pos = torch.arange(context).unsqueeze(0)
            allowed = (key_pos <= query_pos) & ((query_pos - key_pos < window) if window else True)
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start : start + length] = (scores.softmax(-1) @ values).transpose(0, 1).to(q.dtype)
        return out


PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [300, 2, 2, 64],
           [5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22, 23]]


def _greedy(folder, backend: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(folder), dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=8,
              attention_backend=backend, fused_ops=False, enable_prefix_caching=True)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    # [2, blocks, kv_heads (2), block_size (4), head_dim] in the toy's layout, the paged one otherwise.
    expected = (2, 4) if backend == HeadMajorBackend.name else (4, 2)
    assert all(c.data.shape[2:4] == expected for c in llm.engine.executor.worker.runner.kv_caches)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


@pytest.fixture
def registered():
    register_attention_backend(HeadMajorBackend)
    yield
    del ATTENTION_BACKENDS[HeadMajorBackend.name]


@pytest.mark.parametrize("variant", ["llama", "mistral"])  # mistral: a sliding window shorter than the prompts
def test_a_registered_backend_with_its_own_layout_serves_the_model(registered, tmp_path, variant):
    folder = make_variant(tmp_path, variant)
    ours, reference = _greedy(folder, HeadMajorBackend.name), _greedy(folder, "torch")
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, reference):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
