"""The Triton paged decode kernel and the CUDA attention backend, run on CPU by Triton's interpreter: the same
kernel source a GPU compiles, checked against dense attention (partitions, GQA, windows, soft-capping, quantized
caches) and against the torch backend on a mixed step."""
from __future__ import annotations

import importlib

import pytest
import torch

from octavo.attention.kv_quant import allocate_layer_cache, dequantize, write_kv
from tests.attention.test_backends import BLOCK, KV_HEADS, NUM_BLOCKS, _reference, _step


triton = pytest.importorskip("triton", reason="the triton package (installed with the test extra)")
kernels = importlib.import_module("octavo.kernels.triton_paged_decode")
# Compiled kernels on a GPU, the interpreter on CPU tensors otherwise (tests/conftest.py sets TRITON_INTERPRET).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


def _dense(q, keys, values, lens, window=None, softcap=None):
    """q [n, H, D], keys/values [n, L, KVH, D] -> [n, H, D], each row over its first lens[i] positions."""
    n, heads, dim = q.shape
    group = heads // keys.shape[2]
    out = torch.empty_like(q)
    for i in range(n):
        lo = 0 if window is None else max(0, lens[i] - window)
        k = keys[i, lo:lens[i]].repeat_interleave(group, dim=1)  # [L, H, D]
        v = values[i, lo:lens[i]].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i], k) * dim ** -0.5
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)
    return out


def _paged(keys, values, block_size, generator):
    """Scatter dense [n, L, KVH, D] contexts into a shuffled block pool; returns caches and the block table."""
    n, length, kv_heads, dim = keys.shape
    blocks_per_seq = -(-length // block_size)
    num_blocks = n * blocks_per_seq + 3
    order = torch.randperm(num_blocks, generator=generator)[: n * blocks_per_seq].view(n, blocks_per_seq)
    caches = torch.zeros(2, num_blocks, block_size, kv_heads, dim)
    padded = blocks_per_seq * block_size
    for which, dense in enumerate((keys, values)):
        full = torch.zeros(n, padded, kv_heads, dim)
        full[:, :length] = dense
        caches[which][order] = full.view(n, blocks_per_seq, block_size, kv_heads, dim)
    return caches, order


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (8, 2, 64), (6, 2, 24)])
@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (None, 5.0)])
def test_kernel_matches_dense_attention_across_partitions(heads, kv_heads, dim, window, softcap, monkeypatch):
    monkeypatch.setattr(kernels, "PARTITION_TOKENS", 32)  # several partitions, some empty under the window
    gen = torch.Generator().manual_seed(heads + dim)
    lens = [100, 1, 33, 64]
    keys, values = (torch.randn(4, 100, kv_heads, dim, generator=gen) for _ in range(2))
    q = torch.randn(4, heads, dim, generator=gen)
    caches, table = _paged(keys, values, 16, gen)
    caches, table, lens_t = caches.to(DEVICE), table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = kernels.paged_decode(q.to(DEVICE), caches[0], caches[1], table, lens_t, max(lens), dim ** -0.5, window,
                               softcap)
    torch.testing.assert_close(out.cpu(), _dense(q, keys, values, lens, window, softcap), rtol=1e-5, atol=1e-5)


def test_kernel_reads_a_quantized_cache_through_its_scales():
    gen = torch.Generator().manual_seed(3)
    lens = [45, 7]
    cache = allocate_layer_cache(8, 16, 2, 32, torch.int8, torch.device("cpu"))
    table = torch.tensor([[5, 2, 7], [0, 1, 3]])
    slots = torch.cat([torch.tensor([table[i, p // 16] * 16 + p % 16 for p in range(n)]) for i, n in enumerate(lens)])
    k, v = (torch.randn(len(slots), 2, 32, generator=gen) for _ in range(2))
    write_kv(cache, k, v, slots)
    q = torch.randn(2, 4, 32, generator=gen)
    data, scales = cache.data.to(DEVICE), cache.scales.to(DEVICE)
    out = kernels.paged_decode(q.to(DEVICE), data[0], data[1], table.to(DEVICE), torch.tensor(lens, device=DEVICE),
                               max(lens), 32 ** -0.5, key_scales=scales[0], value_scales=scales[1]).cpu()
    # The reference reads the same stored integers, dequantized by torch.
    flat_scales = cache.scales.transpose(2, 3).reshape(2, -1, 2)
    dense = [dequantize(cache.slots()[i], flat_scales[i], torch.float32) for i in range(2)]
    keys, values = (torch.zeros(2, 45, 2, 32) for _ in range(2))
    start = 0
    for i, n in enumerate(lens):
        keys[i, :n], values[i, :n] = dense[0][slots[start:start + n]], dense[1][slots[start:start + n]]
        start += n
    torch.testing.assert_close(out, _dense(q, keys, values, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(ON_GPU, reason="CPU (interpreter) check of the backend; on a GPU tests/cuda run it in the engine")
@pytest.mark.parametrize("scoring", [(), (0.2, 3.0)])  # default scale; Gemma-style scale and soft cap
@pytest.mark.parametrize("window", [None, 3])
def test_backend_attends_over_a_mixed_step_like_the_reference(window, scoring):
    from octavo.attention.triton_cuda import TritonBackend

    backend = TritonBackend({None, 3})
    inputs = _step(backend)
    gen = torch.Generator().manual_seed(1)
    tokens = inputs.input_ids.shape[0]
    cache = allocate_layer_cache(NUM_BLOCKS, BLOCK, KV_HEADS, 8, torch.float32, torch.device("cpu"))
    every_slot = torch.arange(NUM_BLOCKS * BLOCK)
    write_kv(cache, *(torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, 8, generator=gen) for _ in range(2)), every_slot)
    q = torch.randn(tokens, 4, 8, generator=gen)
    k, v = (torch.randn(tokens, KV_HEADS, 8, generator=gen) for _ in range(2))
    backend.write_kv(cache, k, v, inputs.attn[0])
    out = backend.forward(q, k, v, cache, inputs.attn[0], window, *scoring)
    torch.testing.assert_close(out, _reference(q, k, v, cache, inputs, window, *scoring), rtol=1e-5, atol=1e-5)


def test_backend_only_claims_cuda():
    from octavo.attention.triton_cuda import TritonBackend

    assert not TritonBackend.supports(torch.device("cpu"), torch.float32, torch.float32)
    assert TritonBackend.supports(torch.device("cuda"), torch.bfloat16, torch.int8)
    assert not TritonBackend.supports(torch.device("cuda"), torch.bfloat16, torch.int16)
