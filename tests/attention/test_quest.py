"""Quest sparse attention's parts: a page's bound is never below a key's score over it (exact for a page of
one key); the bounds follow the keys written, as stored (float and int8 caches), and move with a copied
block; decoding reads the first page, the recent ones and the pages of highest bound, and its output is
dense attention over exactly those pages."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.attention.base import StepLayout
from octavo.attention.kv_quant import allocate_layer_cache, copy_blocks, gather_blocks, write_kv
from octavo.attention.native_cpu import NativeCpuBackend
from octavo.attention.quest import QuestBackend, page_score_bounds, record_key_bounds
from octavo.attention.torch_sdpa import TorchSdpaBackend
from octavo.attention.triton_cuda import TritonBackend

CPU = torch.device("cpu")
BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), pages=st.integers(1, 6), block=st.integers(1, 8),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), scale=st.floats(0.01, 100.0))
def test_a_page_bound_is_at_least_every_key_score(seed, pages, block, kv_heads, group, scale):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(1, heads, DIM, generator=g, dtype=torch.float64) * scale
    keys = torch.randn(pages, block, kv_heads, DIM, generator=g, dtype=torch.float64) * scale
    bounds = torch.stack((keys.amin(dim=1), keys.amax(dim=1)), dim=2).transpose(0, 1).unsqueeze(1)  # [H, 1, P, 2, D]
    bound = page_score_bounds(q, bounds)[0]  # [pages, heads]
    per_head = keys.repeat_interleave(group, dim=2)  # query head h reads KV head h // group
    scores = torch.einsum("hd,pbhd->pbh", q[0], per_head)
    assert (bound >= scores.amax(dim=1) - 1e-9 * scale**2).all()
    # A page of one key is bounded by that key's score itself: the bound is tight.
    if block == 1:
        torch.testing.assert_close(bound, scores[:, 0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_bounds_follow_the_keys_as_stored(dtype):
    g = torch.Generator().manual_seed(3)
    cache = allocate_layer_cache(6, BLOCK, KV_HEADS, DIM, dtype, CPU, key_bounds=True)
    cache.key_bounds.fill_(1e6)  # what a block's previous owner could have left
    slots = torch.tensor([8, 9, 10, 11, 12, 13])  # block 2 whole, block 3 partly: a prompt
    for step in (slots, torch.tensor([14]), torch.tensor([15, 16])):  # decodes reach into block 4
        k = torch.randn(len(step), KV_HEADS, DIM, generator=g) * 3
        write_kv(cache, k, torch.zeros_like(k), step)
        record_key_bounds(cache, step)
    stored = gather_blocks(cache, 0, torch.tensor([2, 3, 4]), torch.float32).view(3, BLOCK, KV_HEADS, DIM)
    for i, (block, used) in enumerate(((2, 4), (3, 4), (4, 1))):
        assert torch.equal(cache.key_bounds[:, block, 0].float(), stored[i, :used].amin(dim=0))
        assert torch.equal(cache.key_bounds[:, block, 1].float(), stored[i, :used].amax(dim=0))
    # Copy-on-write copies a block's bounds with its keys.
    copy_blocks(cache, torch.tensor([4]), torch.tensor([5]))
    assert torch.equal(cache.key_bounds[:, 5], cache.key_bounds[:, 4])


def _layout(contexts: list[int], tables: list[list[int]]) -> StepLayout:
    """A decode step: row i's token is position contexts[i] - 1 of the blocks tables[i]."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    last = [t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for c, t in zip(contexts, tables)]
    return StepLayout(block_size=BLOCK, num_decodes=len(contexts), query_starts=list(range(len(contexts))),
                      query_lens=[1] * len(contexts), context_lens=contexts,
                      blocks_needed=[-(-c // BLOCK) for c in contexts], block_table=table,
                      slot_mapping=torch.tensor(last), device=CPU)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention of q [heads, D] over keys, values [n, kv_heads, D]."""
    group = q.shape[0] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("hd,nhd->hn", q, k) / math.sqrt(q.shape[-1]), dim=-1)
    return torch.einsum("hn,nhd->hd", probs, v)


def _inner(name: str):
    """The decode backend Quest wraps: the native kernel, or the Triton one (Triton's interpreter on CPU
    tensors without a GPU, as tests/conftest.py sets up)."""
    if name == "native":
        return NativeCpuBackend.create({None}, required=True)
    pytest.importorskip("triton", reason="the triton package (installed with the test extra)")
    return TritonBackend({None})


@pytest.mark.parametrize("inner", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_decode_reads_the_pages_the_bound_chooses(dtype, inner):
    """Three rows over noise keys; in each of the two long rows one page in the middle holds the only key
    pointing along the query. With one page to choose besides the first and two recent ones, that page is
    read and the others between are not; the row of four pages stays dense. Every output equals plain
    attention over the pages read, through either decode kernel (Triton's takes int32 context lengths)."""
    g = torch.Generator().manual_seed(11)
    contexts = [38, 30, 15]  # 10, 8 and 4 pages (the last ones partial)
    needles = [5, 3]  # the page of each long row holding its one high-scoring key
    tables, free = [], iter(range(1, 40))
    for c in contexts:
        tables.append([next(free) for _ in range(-(-c // BLOCK))])
    num_blocks = 40
    cache = allocate_layer_cache(num_blocks, BLOCK, KV_HEADS, DIM, dtype, CPU, key_bounds=True)
    q = torch.randn(len(contexts), HEADS, DIM, generator=g)
    for row, (c, table) in enumerate(zip(contexts, tables)):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c)])
        keys = torch.randn(c, KV_HEADS, DIM, generator=g) * 0.05
        values = torch.randn(c, KV_HEADS, DIM, generator=g)
        if row < len(needles):
            keys[needles[row] * BLOCK + 1, 1] = q[row, 2] * 4  # KV head 1, read by query heads 2 and 3
        write_kv(cache, keys, values, slots)
        record_key_bounds(cache, slots)
    layout = _layout(contexts, tables)
    backend = QuestBackend(_inner(inner), top_pages=2, recent_pages=2)
    meta = backend.build_metadata(layout)
    chosen = meta.pages.choose(q, cache.key_bounds, meta.dense.decode_block_table)
    assert chosen[0].tolist() == [0, 5, 8, 9] and chosen[1].tolist() == [0, 3, 6, 7]
    assert chosen[2].tolist() == [0, 1, 2, 3]  # dense: all its pages
    out = backend.forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache, meta, None)
    read = [[tables[0][p] for p in (0, 5, 8, 9)], [tables[1][p] for p in (0, 3, 6, 7)], tables[2]]
    lens = [3 * BLOCK + contexts[0] - 9 * BLOCK, 3 * BLOCK + contexts[1] - 7 * BLOCK, contexts[2]]
    for row in range(len(contexts)):
        ids = torch.tensor(read[row])
        keys = gather_blocks(cache, 0, ids, torch.float32)[: lens[row]]
        values = gather_blocks(cache, 1, ids, torch.float32)[: lens[row]]
        torch.testing.assert_close(out[row], _reference(q[row], keys, values), rtol=1e-5, atol=1e-5)


def test_quest_needs_a_decode_kernel_over_block_tables():
    with pytest.raises(ValueError, match="sparse_attention 'quest'.*attention_backend native .* got 'torch'"):
        QuestBackend(TorchSdpaBackend({None}), top_pages=4, recent_pages=1)
