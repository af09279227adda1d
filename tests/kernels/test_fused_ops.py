"""The fused elementwise kernels against the torch ops they replace.

In bf16 and f16 each kernel rounds where torch rounds, so most results are
bit-identical; the RMSNorm sum runs in a different order, so a few elements
may differ by one unit in the last place."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from octavo.attention.kv_quant import LayerKVCache, allocate_layer_cache, write_kv
from octavo.kernels.fused_ops import FusedOps, fused_ops
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 1 row (decode at batch 1, single-threaded) and 300 rows (split across threads).
ROWS = [1, 300]


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    return fused_ops(required=True)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ulp_close(ours: torch.Tensor, ref: torch.Tensor, max_fraction: float) -> None:
    """Half precision: within one unit in the last place everywhere, and
    different at all in at most ``max_fraction`` of the elements. float32:
    close (the kernels sum and multiply in another order)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        return
    info = torch.finfo(ref.dtype)
    torch.testing.assert_close(ours, ref, rtol=2 * info.eps, atol=info.tiny)
    assert (ours != ref).float().mean().item() <= max_fraction


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data = weight
    return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [768, 100])  # 100: not a multiple of the vector width
def test_rms_norm(ops, dtype, rows, dim):
    x, w = _randn(rows, dim, dtype=dtype, seed=1), _randn(dim, dtype=dtype, seed=2)
    _ulp_close(ops.rms_norm(x, w, 1e-6), _torch_norm(x, w, 1e-6), max_fraction=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_with_residual_updates_the_stream(ops, dtype, rows):
    x, res, w = (_randn(rows, 256, dtype=dtype, seed=s) for s in (3, 4, 5))
    w = w[0]
    stream = res.clone()
    out = ops.rms_norm(x, w, 1e-5, stream)
    assert torch.equal(stream, x + res)  # the add, rounded as torch rounds it
    _ulp_close(out, _torch_norm(x + res, w, 1e-5), max_fraction=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(ops, dtype, rows):
    gate_up = _randn(rows, 2 * 520, dtype=dtype, seed=6) * 4  # wide range: both exp branches
    ref = F.silu(gate_up[:, :520]) * gate_up[:, 520:]
    _ulp_close(ops.silu_mul(gate_up), ref, max_fraction=1e-3)


def test_silu_mul_extremes(ops):
    gate = torch.tensor([[-200.0, -88.0, -20.0, 0.0, 20.0, 88.0, 200.0, float("inf")]])
    out = ops.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    torch.testing.assert_close(out, F.silu(gate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 4, 64), (14, 2, 64), (4, 4, 40)])
def test_rotary_and_cache_write(ops, dtype, rows, heads, kv_heads, head_dim):
    qkv = _randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7)
    positions = torch.randint(0, 4000, (rows,), generator=torch.Generator().manual_seed(8))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = RotaryEmbedding.apply(q.reshape(rows, heads, head_dim), cos[:, None], sin[:, None])
    want_k = RotaryEmbedding.apply(k.reshape(rows, kv_heads, head_dim), cos[:, None], sin[:, None])
    num_blocks, block_size = 40, 16
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(9))[:rows]
    want_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    write_kv(LayerKVCache(want_cache), want_k, v.reshape(rows, kv_heads, head_dim), slots)

    cache = torch.zeros_like(want_cache)
    flat = cache.view(2, -1, kv_heads, head_dim)
    ours = qkv.clone()
    ops.rotary_write_kv(ours, heads, kv_heads, cos, sin, flat[0], flat[1], slots)
    assert torch.equal(ours[:, : heads * head_dim].view(rows, heads, head_dim), want_q)
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_writes_a_quantized_cache_as_torch_does(ops, rows, dtype, cache_dtype, static):
    """The same bytes and scales as kv_quant.write_kv (the torch path) stores
    from the rotated k and v, with per-row scales or the checkpoint's static ones."""
    heads, kv_heads, head_dim, num_blocks, block_size = 12, 4, 64, 40, 16
    qkv = _randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7) * 3
    qkv[0, heads * head_dim : (heads + 1) * head_dim] = 0  # an all-zero K head row
    emb = torch.rand(rows, head_dim, generator=torch.Generator().manual_seed(8)) * 6
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_k = RotaryEmbedding.apply(k.reshape(rows, kv_heads, head_dim), cos[:, None], sin[:, None])
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(9))[:rows]
    fixed = torch.tensor([[0.01, 0.02, 0.03, 0.04], [0.05, 0.01, 0.02, 0.03]]) if static else None
    want = allocate_layer_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, torch.device("cpu"), fixed)
    write_kv(want, want_k, v.reshape(rows, kv_heads, head_dim), slots)

    ours = allocate_layer_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, torch.device("cpu"), fixed)
    flat = ours.slots()
    ops.rotary_write_kv(qkv, heads, kv_heads, cos, sin, flat[0], flat[1], slots, ours.scales, ours.static_scales)
    assert torch.equal(ours.scales, want.scales)
    assert torch.equal(ours.data.view(torch.uint8), want.data.view(torch.uint8))


def test_rotary_rejects_bad_input(ops):
    qkv = torch.zeros(2, (4 + 2 * 2) * 8)
    cos = sin = torch.zeros(2, 8)
    cache = torch.zeros(10, 2, 8)
    with pytest.raises(ValueError, match="slots must lie in"):
        ops.rotary_write_kv(qkv, 4, 2, cos, sin, cache, cache.clone(), torch.tensor([3, 10]))
    assert not cache.any()  # nothing written
    with pytest.raises(ValueError, match="qkv width"):
        ops.rotary_write_kv(qkv, 4, 1, cos, sin, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slots must be a contiguous CPU torch.int64"):
        ops.rotary_write_kv(qkv, 4, 2, cos, sin, cache, cache.clone(), torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("vocab", [32000, 1001])
def test_argmax_first_maximum(ops, dtype, rows, vocab):
    logits = _randn(rows, vocab, dtype=dtype, seed=10)
    # Ties: the first index wins, as in torch, also between vector lanes.
    logits[:, 123] = logits[:, vocab - 1000] = logits.max() + 1
    logits[0, :] = 0
    if rows > 1:
        logits[1, :] = float("-inf")
        logits[2, vocab - 1] = logits.max() + 2  # the last, lone element of a partial vector
        logits[3, :] = logits[3, :] - 100  # every value negative: masked tail lanes must not win
    assert torch.equal(ops.argmax(logits), logits.float().max(dim=-1).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_nan_wins_like_torch(ops, dtype):
    logits = torch.zeros(3, 1000)
    logits[0, 10] = 5.0
    logits[0, 500] = float("nan")
    logits[1, 7] = float("-inf")
    logits[2, 999] = float("nan")
    logits = logits.to(dtype)
    assert ops.argmax(logits).tolist() == logits.max(dim=-1).indices.tolist() == [500, 0, 999]


def test_inputs_are_checked(ops):
    with pytest.raises(ValueError, match="x must be a contiguous"):
        ops.rms_norm(torch.zeros(4, 8).t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="weight has shape"):
        ops.rms_norm(torch.zeros(4, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="gate_up must be"):
        ops.silu_mul(torch.zeros(4, 7))
