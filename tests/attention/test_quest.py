"""Quest sparse attention's parts: a page's bound is never below a key's score over it (exact for a page of
one key); the bounds follow the keys written, as stored (float and int8 caches), and move with a copied
block; decoding reads the first page, the recent ones and the pages of highest bound, and its output is
dense attention over exactly those pages. The native kernels (octavo/kernels/quest_pages.c) keep the same
bounds as the torch ops, bit for bit, and choose the same pages as the torch choice, whose output they then
give exactly; reading every page is dense attention exactly; a recorded step replays the choice."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.attention.base import StepLayout
from octavo.attention.kv_quant import allocate_layer_cache, copy_blocks, gather_blocks, write_kv
from octavo.attention.native_cpu import NativeCpuBackend
from octavo.attention.quest import NativePageChoice, QuestBackend, page_choice, page_score_bounds, record_key_bounds
from octavo.kernels.quest_pages import quest_pages_kernel
from octavo.attention.torch_sdpa import TorchSdpaBackend
from octavo.attention.triton_cuda import TritonBackend
from octavo.worker.kernel_tape import record_tape

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
    chosen = _chosen(meta, meta.pages.narrow(q, cache, meta))
    assert chosen == [[0, 5, 8, 9], [0, 3, 6, 7], [0, 1, 2, 3]]  # the last row dense: all its pages
    out = backend.forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache, meta, None)
    read = [[tables[0][p] for p in (0, 5, 8, 9)], [tables[1][p] for p in (0, 3, 6, 7)], tables[2]]
    lens = [3 * BLOCK + contexts[0] - 9 * BLOCK, 3 * BLOCK + contexts[1] - 7 * BLOCK, contexts[2]]
    for row in range(len(contexts)):
        ids = torch.tensor(read[row])
        keys = gather_blocks(cache, 0, ids, torch.float32)[: lens[row]]
        values = gather_blocks(cache, 1, ids, torch.float32)[: lens[row]]
        torch.testing.assert_close(out[row], _reference(q[row], keys, values), rtol=1e-5, atol=1e-5)


def _chosen(dense, cut, block: int = BLOCK) -> list[list[int]]:
    """Each decode row's pages read, as positions in its dense table, from the metadata the choice cut."""
    out = []
    for row in range(dense.num_decodes):
        table = dense.decode_block_table[row].tolist()
        read = cut.decode_block_table[row, : -(-int(cut.decode_context_lens[row]) // block)].tolist()
        out.append([table.index(b) for b in read])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])
def test_native_bounds_are_the_torch_bounds(dtype):
    """The same keys written to two caches, folded by the torch ops and by the kernel: the same bounds, bit for
    bit, through a prompt, decodes reaching into a new block and a block reused from its first slot."""
    kernel = quest_pages_kernel(required=True)
    g = torch.Generator().manual_seed(5)
    caches = [allocate_layer_cache(8, BLOCK, KV_HEADS, DIM, dtype, CPU, key_bounds=True) for _ in range(2)]
    for cache in caches:
        cache.key_bounds.fill_(1e4)  # what a block's previous owner could have left
    for step in ([8, 9, 10, 11, 12, 13], [14], [15, 16], [28, 29, 30]):
        slots = torch.tensor(step)
        k = torch.randn(len(step), KV_HEADS, DIM, generator=g) * 3
        for cache in caches:
            write_kv(cache, k, torch.zeros_like(k), slots)
        record_key_bounds(caches[0], slots)
        native = caches[1]
        kernel.fold_bounds(native.data[0], None if native.scales is None else native.scales[0], native.key_bounds,
                           slots)
        assert torch.equal(native.key_bounds, caches[0].key_bounds)
    with pytest.raises(ValueError, match="slots must lie in"):
        kernel.fold_bounds(native.data[0], None, native.key_bounds, torch.tensor([8 * BLOCK]))


def _random_step(contexts: list[int], block: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """A cache of random keys and values (bounds kept) under shuffled block tables, and a decode layout over it."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-c // block) for c in contexts]
    num_blocks = sum(pages) + 1
    cache = allocate_layer_cache(num_blocks, block, kv_heads, dim, dtype, CPU, key_bounds=True)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in pages]
    for c, table in zip(contexts, tables):
        slots = torch.tensor([table[p // block] * block + p % block for p in range(c)])
        keys, values = (torch.randn(c, kv_heads, dim, generator=g) for _ in range(2))
        write_kv(cache, keys, values, slots)
        record_key_bounds(cache, slots)
    # The decode rows' q as the engine hands it over: a view of the fused projection's rows, in the model's
    # dtype (float32 beside a quantized cache).
    model_dtype = dtype if dtype.is_floating_point and dtype.itemsize > 1 else torch.float32
    qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * dim, generator=g).to(model_dtype)
    q = qkv[:, : heads * dim].view(len(contexts), heads, dim)
    width = max(pages)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    last = [t[(c - 1) // block] * block + (c - 1) % block for c, t in zip(contexts, tables)]
    layout = StepLayout(block_size=block, num_decodes=len(contexts), query_starts=list(range(len(contexts))),
                        query_lens=[1] * len(contexts), context_lens=contexts, blocks_needed=pages,
                        block_table=table, slot_mapping=torch.tensor(last), device=CPU)
    return cache, q, layout


# (contexts, block size): batch 1 at several lengths, batch 5 of mixed ones (a row of exactly top + recent pages
# and one of a single page among them), block sizes the engine is run with.
CHOICES = [([300], 16), ([2100], 16), ([2100, 1100, 160, 161, 9], 16), ([1000], 32), ([1300, 97, 700, 640, 40], 32),
           ([700, 33], 8)]


@pytest.mark.parametrize(("contexts", "block"), CHOICES, ids=[f"{len(c)}x{max(c)}-block{b}" for c, b in CHOICES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_native_choice_is_the_torch_choice(contexts, block, dtype):
    """Qwen2.5-0.5B's heads (14 over 2 KV heads of 64): the kernel reads the pages the torch choice reads, cuts
    the same lengths, and the decode over them gives the torch choice's output exactly."""
    cache, q, layout = _random_step(contexts, block, 14, 2, 64, dtype, seed=len(contexts) * block)
    inner = NativeCpuBackend.create({None}, required=True)
    dense = inner.build_metadata(layout)
    kernel = quest_pages_kernel(required=True)
    for top, recent in ((8, 2), (1, 1), (3, 4)):
        by_torch = page_choice(dense, block, top, recent).narrow(q, cache, dense)
        native = NativePageChoice.empty(kernel, len(contexts), top, recent, CPU).narrow(q, cache, dense)
        assert _chosen(dense, native, block) == _chosen(dense, by_torch, block)
        assert torch.equal(native.decode_context_lens, by_torch.decode_context_lens)
        assert all(len(p) == min(-(-c // block), top + recent) for p, c in zip(_chosen(dense, native, block), contexts))
        k = v = q[:, :2]
        assert torch.equal(inner.forward(q, k, v, cache, native, None), inner.forward(q, k, v, cache, by_torch, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_reading_every_page_through_the_kernel_is_dense_exactly(dtype):
    contexts = [1000, 37, 400]
    cache, q, layout = _random_step(contexts, 16, HEADS, KV_HEADS, DIM, dtype, seed=2)
    inner = NativeCpuBackend.create({None}, required=True)
    dense = inner.build_metadata(layout)
    every = NativePageChoice.empty(quest_pages_kernel(required=True), 3, 60, 3, CPU).narrow(q, cache, dense)
    assert _chosen(dense, every, 16) == [list(range(-(-c // 16))) for c in contexts]
    k = v = q[:, :KV_HEADS]
    assert torch.equal(inner.forward(q, k, v, cache, every, None), inner.forward(q, k, v, cache, dense, None))


def test_a_recorded_step_replays_the_choice():
    """A Quest decode step recorded as a kernel tape over the static buffers, replayed with other rows, tables
    and queries written into them, gives what an eager step over a fresh layout of the same rows gives."""
    backend = QuestBackend(NativeCpuBackend.create({None}, required=True), top_pages=2, recent_pages=1)
    cache, q, layout = _random_step([300, 170, 50], BLOCK * 4, HEADS, KV_HEADS, DIM, torch.float32, seed=9)
    static = backend.static_decode_metadata(3, 20, 0, 0, 20 * BLOCK * 4, CPU)
    q_static = torch.zeros_like(q)
    tape, out = record_tape(lambda: backend.forward(q_static, q_static[:, :KV_HEADS], q_static[:, :KV_HEADS],
                                                    cache, static, None))
    assert tape.num_kernel_calls == 3 and tape.num_torch_ops == 0  # bounds, choice, decode
    for rows in ([0, 1, 2], [2, 0, 1]):
        meta = backend.build_metadata(layout)
        width = meta.decode_block_table.shape[1]
        q_static.copy_(q[rows])
        static.slot_mapping.copy_(meta.slot_mapping[rows])
        static.decode_block_table[:, :width].copy_(meta.decode_block_table[rows])
        static.decode_context_lens.copy_(meta.decode_context_lens[rows])
        tape.replay()
        want = backend.forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache, meta, None)
        assert torch.equal(out, want[rows])


def test_quest_needs_a_decode_kernel_over_block_tables():
    with pytest.raises(ValueError, match="sparse_attention 'quest'.*attention_backend native .* got 'torch'"):
        QuestBackend(TorchSdpaBackend({None}), top_pages=4, recent_pages=1)
