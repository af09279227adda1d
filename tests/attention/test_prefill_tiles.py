"""A prefill chunk after a long cached context reads it tile by tile: the tiles cover exactly the keys
its queries see, and nothing the attention allocates grows with the context."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from octavo.attention import prefill
from octavo.attention.kv_quant import allocate_layer_cache
from octavo.attention.registry import select_attention_backend
from octavo.core.request import Request
from octavo.core.step_state import ScheduledRow
from octavo.sampling_params import SamplingParams
from octavo.worker.input_batch import prepare_inputs

CPU = torch.device("cpu")


def _chunk_inputs(backend, start: int, q_len: int, block_size: int, table: list[int]):
    request = Request("r", list(range(start + q_len)), SamplingParams())
    return prepare_inputs([ScheduledRow(request, start, q_len, [table], True)], block_size, backend, CPU)


@pytest.mark.parametrize("window", [None, 50, 300])
def test_tiles_cover_exactly_what_the_queries_see(monkeypatch, window):
    """Positions 200..231 of a request, tiles of 4 blocks of 16: the concatenated tiles (a tile without a
    mask: every query sees every key) equal the causal, windowed mask over every key from the first tile
    on, and no query sees a key before it (a window group has released those blocks)."""
    monkeypatch.setattr(prefill, "KEY_TILE", 64)
    table = list(range(100, 115))
    backend = select_attention_backend("torch", CPU, torch.float32, torch.float32, {window})
    (chunk,) = _chunk_inputs(backend, 200, 32, 16, table).attn[0].prefills
    tiles = chunk.tiles[window]
    assert all(len(t.block_ids) <= 4 for t in tiles)
    first_block = table.index(tiles[0].block_ids[0].item())
    assert torch.cat([t.block_ids for t in tiles]).tolist() == table[first_block:]
    query_pos = torch.arange(200, 232).unsqueeze(1)
    whole = prefill.window_mask(query_pos, torch.arange(232), window)
    assert not whole[:, : first_block * 16].any()
    got = torch.cat([t.mask if t.mask is not None else torch.ones(32, t.num_keys, dtype=torch.bool)
                     for t in tiles], dim=1)
    assert torch.equal(got, whole[:, first_block * 16 :])
    if window is None:  # the prefix every query sees needs no mask; the tile with the chunk's rows does
        assert first_block == 0 and [t.mask is None for t in tiles] == [True, True, True, False]
    else:
        assert first_block == max(0, 200 - window + 1) // 16


class _LargestTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor any op allocates (views of its inputs are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return result


def _chunk_attention(context: int, q_len: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A bf16 chunk of ``q_len`` queries ending a ``context``-token request (2 query heads over 1 KV head
    of 16), its context in the cache: (the largest tensor the attention made, its output, the exact
    attention of its last 8 queries)."""
    block, heads, dim = 16, 2, 16
    gen = torch.Generator().manual_seed(0)
    blocks = context // block
    cache = allocate_layer_cache(blocks, block, 1, dim, torch.bfloat16, CPU)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    backend = select_attention_backend("torch", CPU, torch.bfloat16, torch.bfloat16, {None})
    table = torch.randperm(blocks, generator=gen).tolist()
    q = torch.randn(q_len, heads, dim, generator=gen).to(torch.bfloat16)
    with torch.inference_mode(), _LargestTensor() as spy:  # the step's metadata and the layer's attention
        meta = _chunk_inputs(backend, context - q_len, q_len, block, table).attn[0]
        k, v = cache.slots()[:, meta.slot_mapping].unbind(0)  # the chunk's own rows, as written
        out = backend.forward(q, k, v, cache, meta, None)
    keys, values = (cache.slots()[i, torch.tensor(table)[torch.arange(context) // block] * block
                                     + torch.arange(context) % block].float() for i in (0, 1))
    scores = torch.einsum("qhd,kd->hqk", q[-8:].float(), keys[:, 0]) * dim**-0.5
    exact = torch.einsum("hqk,kd->qhd", torch.softmax(scores, dim=-1), values[:, 0])
    return spy.largest, out, exact


def test_a_chunk_over_a_long_context_allocates_nothing_that_grows_with_it():
    """A 2048-query chunk at the end of 16k and 32k contexts: the largest tensor is the same for both and
    within one tile's float32 mask (4 bytes x queries x KEY_TILE), where a [queries, context] mask alone
    took 64 MiB at 32k (and SDPA's float copy of it, made where no spy sees, 256 MiB)."""
    q_len = 2048
    at_16k, _, _ = _chunk_attention(16384, q_len)
    at_32k, out, exact = _chunk_attention(32768, q_len)
    assert at_16k == at_32k <= 4 * q_len * prefill.KEY_TILE
    torch.testing.assert_close(out[-8:].float(), exact, atol=2e-2, rtol=2e-2)
