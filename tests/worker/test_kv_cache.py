"""KV cache sizing and block copies, step input preparation, runner attributes."""
from __future__ import annotations

import pytest
import torch

from octavo.config import CacheConfig, ModelConfig, SchedulerConfig
from octavo.attention.kv_quant import LayerKVCache, allocate_layer_cache, write_kv
from octavo.attention.torch_sdpa import TorchSdpaBackend
from octavo.core.step_state import ScheduledRow
from octavo.worker.input_batch import prepare_inputs
from octavo.attention.kv_spec import KVCacheSpec, SlidingWindowSpec
from octavo.worker.kv_cache import allocate_kv_caches, bytes_per_block, copy_blocks, num_cache_blocks
from octavo.worker.memory import available_memory_bytes
from octavo.worker.model_runner import ModelRunner

from .runner_utils import Blocks, make_request, make_runner, step

LAYER = KVCacheSpec(block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)
SHAPE = [LAYER, LAYER]  # two layers
CPU = torch.device("cpu")


def test_bytes_per_block():
    assert bytes_per_block(SHAPE) == 2 * 2 * 16 * 2 * 16 * 4
    half = KVCacheSpec(16, 2, 16, torch.bfloat16)
    assert bytes_per_block([half, half]) * 2 == bytes_per_block(SHAPE)
    # A sliding layer keeps as much per block (its blocks are not yet released outside the window).
    assert SlidingWindowSpec(16, 2, 16, torch.float32, window=8).bytes_per_block == LAYER.bytes_per_block


def test_num_blocks_precedence():
    per_block = bytes_per_block(SHAPE)
    assert num_cache_blocks(CacheConfig(num_blocks=7, kv_cache_memory_bytes=per_block * 100), SHAPE, CPU) == 7
    assert num_cache_blocks(CacheConfig(kv_cache_memory_bytes=per_block * 10 + 5), SHAPE, CPU) == 10
    blocks = num_cache_blocks(CacheConfig(memory_fraction=0.01), SHAPE, CPU)
    assert 1 <= blocks <= available_memory_bytes(CPU) * 0.011 // per_block
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        num_cache_blocks(CacheConfig(kv_cache_memory_bytes=per_block - 1), SHAPE, CPU)


def test_quantized_blocks_hold_about_twice_the_tokens():
    """Same budget: one byte per element plus a float32 scale per token and
    KV head against two bytes per element."""
    budget = CacheConfig(kv_cache_memory_bytes=64 * 2**20)
    for head_dim, ratio in ((64, 128 / 68), (128, 256 / 132)):
        bf16 = num_cache_blocks(budget, [KVCacheSpec(16, 4, head_dim, torch.bfloat16)] * 12, CPU)
        for dtype in (torch.int8, torch.float8_e4m3fn):
            shape = [KVCacheSpec(16, 4, head_dim, dtype)] * 12
            assert bytes_per_block(shape) == 2 * 12 * 16 * 4 * (head_dim + 4)
            quant = num_cache_blocks(budget, shape, CPU)
            assert abs(quant / bf16 - ratio) < 0.01 and quant / bf16 > 1.85


def test_allocation_counts_the_scale_bytes_and_says_so(caplog):
    shape = [KVCacheSpec(16, 2, 64, torch.int8), SlidingWindowSpec(16, 2, 64, torch.int8, window=32)]
    with caplog.at_level("INFO", logger="octavo.worker.kv_cache"):
        caches = allocate_kv_caches(shape, TorchSdpaBackend({None, 32}), 5, CPU)
    data_and_scales = sum(c.data.nbytes + c.scales.nbytes for c in caches)
    assert data_and_scales == 5 * bytes_per_block(shape)
    assert caches[0].scales.shape == (2, 5, 2, 16) and caches[0].scales.dtype == torch.float32
    assert "5 blocks x 16 tokens = 80 tokens" in caplog.text and "int8 + float32 scales" in caplog.text
    assert "1 layer full: 2 KV heads x 64" in caplog.text
    assert "1 layer sliding window 32: 2 KV heads x 64" in caplog.text


@pytest.mark.parametrize("dtype, bound_bytes", [(torch.bfloat16, 2), (torch.int8, 4)])
def test_allocation_counts_the_key_bounds_and_says_so(caplog, dtype, bound_bytes):
    """Sparse attention's key bounds: a minimum and a maximum per block, KV head and channel, in the cache's
    float dtype (float32 for a quantized cache), in the pool's bytes per block and the start-up line."""
    spec = KVCacheSpec(16, 2, 64, dtype, key_bounds=True)
    assert spec.bytes_per_block == KVCacheSpec(16, 2, 64, dtype).bytes_per_block + 2 * 2 * 64 * bound_bytes
    with caplog.at_level("INFO", logger="octavo.worker.kv_cache"):
        (cache,) = allocate_kv_caches([spec], TorchSdpaBackend({None}), 5, CPU)
    stored = [t for t in (cache.data, cache.scales, cache.key_bounds) if t is not None]
    assert sum(t.nbytes for t in stored) == 5 * spec.bytes_per_block
    assert cache.key_bounds.shape == (2, 5, 2, 64) and cache.key_bounds.element_size() == bound_bytes
    assert f"{5 * spec.bytes_per_block // 80} bytes per token" in caplog.text and "key min/max per block" in caplog.text


def _filled(dtype: torch.dtype, seed: int) -> LayerKVCache:
    cache = allocate_layer_cache(6, 4, 2, 8, dtype, CPU)
    gen = torch.Generator().manual_seed(seed)
    write_kv(cache, torch.randn(24, 2, 8, generator=gen), torch.randn(24, 2, 8, generator=gen), torch.arange(24))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_copy_blocks_every_layer(dtype):
    caches = [_filled(dtype, seed) for seed in range(3)]
    before = [LayerKVCache(c.data.clone(), None if c.scales is None else c.scales.clone()) for c in caches]
    copy_blocks(caches, [(1, 4), (2, 0)])
    for c, b in zip(caches, before):
        for now, then in [(c.data.view(torch.uint8), b.data.view(torch.uint8))] + (
            [(c.scales, b.scales)] if c.quantized else []
        ):
            assert torch.equal(now[:, 4], then[:, 1]) and torch.equal(now[:, 0], then[:, 2])
            assert torch.equal(now[:, [1, 2, 3, 5]], then[:, [1, 2, 3, 5]])


def test_prepare_inputs_layout():
    a = make_request("a", list(range(10, 30)))  # prefill of 20 in 2 blocks of 16
    b = make_request("b", list(range(5)))
    scheduled = [
        ScheduledRow(a, 4, 16, [[7, 2]], True),  # positions 4..19
        ScheduledRow(b, 4, 1, [[3]], True),
    ]
    inputs = prepare_inputs(scheduled, 16, TorchSdpaBackend({None, 4}), CPU)
    assert [s.request.request_id for s in inputs.order] == ["b", "a"]  # decodes first
    assert inputs.q_starts == [0, 1]
    assert inputs.input_ids.tolist() == [4] + list(range(14, 30))
    assert inputs.positions.tolist() == [4] + list(range(4, 20))
    expected_slots = [3 * 16 + 4] + [7 * 16 + p for p in range(4, 16)] + [2 * 16 + p - 16 for p in range(16, 20)]
    assert inputs.attn[0].slot_mapping.tolist() == expected_slots
    (attn,) = inputs.attn
    (group,) = attn.decode_groups
    assert attn.num_decodes == 1 and group.block_table.tolist() == [[3]]
    assert group.masks[None][0, 0, 0].tolist() == [True] * 5 + [False] * 11
    assert group.masks[4][0, 0, 0].tolist() == [False] + [True] * 4 + [False] * 11
    (chunk,) = attn.prefills
    assert (chunk.q_start, chunk.q_end, chunk.context_len, chunk.fresh) == (1, 17, 20, False)
    # One tile of both blocks per window, masked: the chunk's own rows are among its keys.
    (full,), (windowed,) = chunk.tiles[None], chunk.tiles[4]
    assert full.block_ids.tolist() == windowed.block_ids.tolist() == [7, 2]
    assert full.num_keys == windowed.num_keys == 20
    assert full.mask.shape == (16, 20) and full.mask[0].tolist() == [True] * 5 + [False] * 15
    assert windowed.mask[-1].tolist() == [False] * 16 + [True] * 4


def test_prepare_inputs_rejects_a_short_block_table():
    req = make_request("a", list(range(20)))
    with pytest.raises(ValueError, match="blocks cannot hold"):
        prepare_inputs([ScheduledRow(req, 0, req.num_prompt_tokens, [[0]], True)], 16, TorchSdpaBackend({None}), CPU)


def test_runner_attributes(variant):
    runner = make_runner(variant("llama"), num_blocks=9, max_model_len=100)
    assert runner.num_blocks == 9 and len(runner.kv_caches) == 2
    # One block more than the scheduler's pool: the null block that recorded decode steps pad into.
    assert runner._graphs is not None and runner.kv_caches[0].data.shape == (2, 10, 16, 2, 16)
    assert runner.kv_caches[0].scales is None
    assert runner.max_model_len == 100
    assert make_runner(variant("llama"), num_blocks=1).max_model_len == 512
    assert runner.vocab_size == 512
    assert runner.arch.architecture == "LlamaForCausalLM"


def test_layers_of_different_kv_cache_groups_share_a_tensor(variant):
    """Gemma 2's tiny layers slide, attend globally, slide: three groups of one layer, all on one
    tensor, so a block id costs one layer's bytes and the same budget holds three times the blocks."""
    folder = variant("gemma2")
    one_layer = make_runner(folder, num_blocks=4).kv_cache_specs[0].bytes_per_block
    runner = ModelRunner(ModelConfig(model=str(folder), dtype="float32"),
                         CacheConfig(kv_cache_memory_bytes=30 * one_layer), SchedulerConfig())
    assert runner.kv_cache_windows == (8, 8, None) and runner.num_blocks == 30
    first = runner.kv_caches[0].data
    assert all(cache.data is first for cache in runner.kv_caches)
    # The spare block after the pool: the null block of released window entries and of recorded steps' padding.
    assert first.shape[1] == 31
    first[:, 1] = 1.0
    runner.execute(step(copies=[(1, 3)]))
    assert torch.equal(first[:, 3], first[:, 1])


def test_empty_step_applies_copies_and_drops_state(variant):
    runner = make_runner(variant("llama"), num_blocks=4)
    runner.kv_caches[0].data[:, 1] = 1.0
    out = runner.execute(step(copies=[(1, 3)]))
    data = runner.kv_caches[0].data
    assert out.sampled_token_ids == {} and torch.equal(data[:, 3], data[:, 1])


def test_partial_prefill_chunk_samples_nothing(variant):
    runner = make_runner(variant("llama"))
    blocks = Blocks(runner)
    req = make_request("a", list(range(3, 40)))
    out = runner.execute(step(blocks.chunk(req, 0, 16, sample=False)))
    assert out.sampled_token_ids == {} and out.logprobs == {} and out.prompt_logprobs == {}


def test_memory_fraction_default_is_capped_by_useful_tokens():
    # 4 sequences of 64 tokens can never need more than 16 blocks of 16 (32 with the prefix-cache margin).
    capped = num_cache_blocks(CacheConfig(block_size=16, memory_fraction=0.5), SHAPE, CPU, max_useful_tokens=256)
    assert capped == 32
    # An explicit byte budget is the user's choice and is not capped.
    explicit = num_cache_blocks(
        CacheConfig(block_size=16, kv_cache_memory_bytes=bytes_per_block(SHAPE) * 100), SHAPE, CPU, max_useful_tokens=256
    )
    assert explicit == 100


def test_ranks_sharing_one_memory_split_its_budget():
    whole = CacheConfig(block_size=16, kv_cache_memory_bytes=bytes_per_block(SHAPE) * 100)
    assert num_cache_blocks(whole, SHAPE, CPU, memory_share=0.5) == 50
    fraction = CacheConfig(block_size=16, memory_fraction=0.01)
    alone, halved = (num_cache_blocks(fraction, SHAPE, CPU, memory_share=s) for s in (1.0, 0.5))
    assert abs(halved - alone / 2) <= 0.01 * alone + 1  # available memory moves a little between the reads


def test_decodes_of_different_lengths_are_grouped_longest_first():
    # Contexts of 3, 40, 200 and 190 tokens (block_size 16: 1, 3, 13 and 12 blocks).
    reqs = [make_request(name, list(range(n))) for name, n in [("a", 3), ("b", 40), ("c", 200), ("d", 190)]]
    scheduled = [
        ScheduledRow(r, r.num_prompt_tokens - 1, 1, [list(range(13))], True) for r in reqs
    ]
    inputs = prepare_inputs(scheduled, 16, TorchSdpaBackend({None}), CPU)
    assert [s.request.request_id for s in inputs.order] == ["c", "d", "b", "a"]
    groups = inputs.attn[0].decode_groups
    # c and d pad to 13 blocks together; b (3 blocks) and a (1 block) would more
    # than double their work if padded to 13, and a to 3, so they go alone.
    assert [(g.row_start, g.row_end, g.block_table.shape[1]) for g in groups] == [(0, 2, 13), (2, 3, 3), (3, 4, 1)]
    # Each row's mask covers exactly its own context.
    assert groups[0].masks[None][1, 0, 0].sum().item() == 190
    assert groups[2].masks[None][0, 0, 0].tolist() == [True] * 3 + [False] * 13
