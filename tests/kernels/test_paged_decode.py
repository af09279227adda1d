"""The native paged decode kernel against SDPA over the same K/V gathered by hand."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from octavo.attention.kv_quant import dequantize, quantize
from octavo.kernels.paged_decode import PagedDecodeKernel, paged_decode_kernel

# (heads, kv_heads, head_dim, block_size, window)
SHAPES = [
    (12, 4, 64, 16, None),  # GQA, llama-100m-like
    (14, 2, 64, 1, None),  # Qwen2.5-0.5B's head layout, one token per block
    (8, 8, 32, 32, 7),  # MHA with a sliding window shorter than most contexts
    (4, 1, 128, 16, 40),  # MQA, window longer than some contexts
]
# Output rounding to the query dtype dominates the difference.
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    return paged_decode_kernel(required=True)


def _case(heads, kv_heads, head_dim, block_size, dtype, lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    width = max(-(-n // block_size) for n in lens)
    # Shuffled block ids and a garbage pad id: a wrong lookup cannot pass by accident.
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), width), num_blocks - 1, dtype=torch.int64)
    for i, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = free.pop()
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64)


def _reference(q, k_cache, v_cache, tables, lens, window):
    rows = []
    for i, n in enumerate(lens.tolist()):
        keys = k_cache[tables[i]].flatten(0, 1)[:n].float()
        values = v_cache[tables[i]].flatten(0, 1)[:n].float()
        if window is not None:
            keys, values = keys[max(0, n - window) :], values[max(0, n - window) :]
        o = F.scaled_dot_product_attention(
            q[i].float().unsqueeze(1), keys.transpose(0, 1), values.transpose(0, 1), enable_gqa=True
        )
        rows.append(o.squeeze(1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_sdpa_on_gathered_blocks(kernel, shape, dtype):
    heads, kv_heads, head_dim, block_size, window = shape
    lens = [1, 5, 17, 40, 33, 16, 100]
    q, kc, vc, tables, ctx = _case(heads, kv_heads, head_dim, block_size, dtype, lens)
    out = kernel(q, kc, vc, tables, ctx, window, 1 / math.sqrt(head_dim))
    assert out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, kc, vc, tables, ctx, window)
    diff = (out.float() - ref).abs().max().item()
    assert diff < TOL[dtype], f"max abs diff {diff}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(12, 4, 64, 16, None), (16, 1, 64, 8, None), (8, 2, 128, 16, 30)])
def test_many_sequences_across_work_chunks(kernel, shape, dtype):
    """More sequences than one thread's chunk, of mixed lengths: the read-ahead
    walks from one sequence into the next and across chunk ends. (16, 1, 64):
    a 16-head group, whose accumulators do not fit in registers."""
    heads, kv_heads, head_dim, block_size, window = shape
    lens = torch.randint(1, 120, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    q, kc, vc, tables, ctx = _case(heads, kv_heads, head_dim, block_size, dtype, lens, seed=4)
    out = kernel(q, kc, vc, tables, ctx, window, 1 / math.sqrt(head_dim))
    diff = (out.float() - _reference(q, kc, vc, tables, ctx, window)).abs().max().item()
    assert diff < TOL[dtype], f"max abs diff {diff}"


@pytest.mark.parametrize("shape", [(32, 8, 128, 16, None), (12, 4, 64, 16, 24)])
def test_a_large_batch_of_mixed_lengths(kernel, shape):
    """A peak-batch decode call: 257 sequences (chunks of work end mid-batch),
    lengths from 1 to several blocks with block edges and their neighbours,
    32/8 heads of 128, or a window of 24 that starts inside a block."""
    heads, kv_heads, head_dim, block_size, window = shape
    edges = [1, 2, 15, 16, 17, 31, 32, 33, 48, 49, 64, 65]
    lens = edges + torch.randint(1, 160, (257 - len(edges),), generator=torch.Generator().manual_seed(9)).tolist()
    q, kc, vc, tables, ctx = _case(heads, kv_heads, head_dim, block_size, torch.bfloat16, lens, seed=10)
    out = kernel(q, kc, vc, tables, ctx, window, 1 / math.sqrt(head_dim))
    diff = (out.float() - _reference(q, kc, vc, tables, ctx, window)).abs().max().item()
    assert diff < TOL[torch.bfloat16], f"max abs diff {diff}"


def _difference_on_threads(kernel, threads, heads, kv_heads, dtype, lens, seed):
    """The largest difference from the reference of the kernel run on ``threads`` torch threads (head_dim 64,
    blocks of 16)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kc, vc, tables, ctx = _case(heads, kv_heads, 64, 16, dtype, lens, seed=seed)
        out = kernel(q, kc, vc, tables, ctx, None, 0.125)
    finally:
        torch.set_num_threads(before)
    return (out.float() - _reference(q, kc, vc, tables, ctx, None)).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[300], [200, 90], [33, 64, 5]])
def test_few_sequences_are_split_by_kv_heads(kernel, dtype, lens):
    """Fewer sequences than ~4 per thread: each is split into items of fewer KV
    heads (so the threads share a long context); every head still comes out right."""
    diff = _difference_on_threads(kernel, 2, 12, 4, dtype, lens, seed=5)
    assert diff < TOL[dtype], f"max abs diff {diff}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[2000], [1999, 517, 33]])
def test_long_contexts_at_one_thread_and_two(kernel, threads, dtype, lens):
    """Qwen2.5-0.5B's 14 / 2 heads of 64 over contexts of up to 125 blocks whose last pages are not full, one
    sequence and several: one thread reads each sequence's rows whole, two split it by KV heads; each way the
    attention over the gathered blocks."""
    diff = _difference_on_threads(kernel, threads, 14, 2, dtype, lens, seed=6)
    assert diff < TOL[dtype], f"max abs diff {diff}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_peaked_softmax_flushes_its_denormals_and_leaves_the_callers_mode(kernel, dtype):
    """Queries 100x larger than the keys' scale put nearly every weight at the bottom of float32's range, where the
    kernel flushes the products it makes with values: the output still matches, and the caller's thread gets back
    its own mode (a denormal result stays one in torch's next op)."""
    lens = [700, 333]
    q, kc, vc, tables, ctx = _case(14, 2, 64, 16, dtype, lens, seed=8)
    q = (q.float() * 100).to(dtype)
    torch.set_flush_denormal(False)
    out = kernel(q, kc, vc, tables, ctx, None, 0.125)
    diff = (out.float() - _reference(q, kc, vc, tables, ctx, None)).abs().max().item()
    # Scores in the hundreds carry float32's rounding (~1e-5 of them) into the weights, flushed or not.
    assert diff < max(TOL[dtype], 1e-4), f"max abs diff {diff}"
    tiny = torch.tensor([1e-39]) * 2
    assert tiny.item() > 0


def _quantized(cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[blocks, block_size, kv_heads, D] -> (values, scales [blocks, kv_heads,
    block_size] as the kernel reads them, the dequantized cache in float32)."""
    blocks, block_size, kv_heads, head_dim = cache.shape
    values, scales = quantize(cache.reshape(-1, kv_heads, head_dim), dtype)
    dense = dequantize(values, scales, torch.float32).view(cache.shape)
    scales = scales.view(blocks, block_size, kv_heads).transpose(1, 2).contiguous()
    return values.view(cache.shape), scales, dense


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", SHAPES + [(16, 1, 64, 8, None), (6, 2, 40, 16, None)])
def test_quantized_cache_matches_sdpa_on_dequantized_blocks(kernel, shape, cache_dtype, q_dtype):
    """int8 / e4m3 values with per-(token, head) scales, read in place: the
    attention of the dequantized cache. head_dim 40 takes the generic path,
    (16, 1, 64) a group too large for register accumulators; 21 sequences
    cross work chunks. An int8 cache's scores take the query in 15 bits
    (int16 with a per-head scale, for vpdpwssd): float32 queries then differ
    by up to ~1e-5 of their largest element, so the bound is 1e-3 there (bf16
    queries: the bf16 bound, their own rounding is coarser)."""
    heads, kv_heads, head_dim, block_size, window = shape
    lens = torch.randint(1, 120, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    q, kc, vc, tables, ctx = _case(heads, kv_heads, head_dim, block_size, torch.float32, lens, seed=4)
    (kq, ks, kd), (vq, vs, vd) = _quantized(kc * 4, cache_dtype), _quantized(vc, cache_dtype)
    q = q.to(q_dtype)
    out = kernel(q, kq, vq, tables, ctx, window, 1 / math.sqrt(head_dim), ks, vs)
    assert out.dtype == q_dtype
    diff = (out.float() - _reference(q, kd, vd, tables, ctx, window)).abs().max().item()
    f32_tol = 1e-3 if cache_dtype == torch.int8 else 1e-5
    assert diff < {torch.float32: f32_tol, torch.bfloat16: TOL[torch.bfloat16]}[q_dtype], f"max abs diff {diff}"


def test_quantized_cache_needs_its_scales(kernel):
    q, kc, vc, tables, ctx = _case(12, 4, 64, 16, torch.float32, [3, 5])
    (kq, ks, _), (vq, vs, _) = _quantized(kc, torch.int8), _quantized(vc, torch.int8)
    with pytest.raises(ValueError, match="needs contiguous float32 v_scales"):
        kernel(q, kq, vq, tables, ctx, None, 0.125, ks, None)
    with pytest.raises(ValueError, match="needs contiguous float32 k_scales"):
        kernel(q, kq, vq, tables, ctx, None, 0.125, ks.transpose(1, 2), vs)


def test_an_empty_context_is_a_value_error(kernel):
    q, kc, vc, tables, ctx = _case(12, 4, 64, 16, torch.bfloat16, [3, 5])
    ctx[1] = 0
    with pytest.raises(ValueError, match="at least 1"):
        kernel(q, kc, vc, tables, ctx, None, 0.125)


def test_bfloat16_queries_over_a_float32_cache(kernel):
    q, kc, vc, tables, ctx = _case(12, 4, 64, 16, torch.float32, [3, 50, 21])
    out = kernel(q.bfloat16(), kc, vc, tables, ctx, None, 0.125)
    ref = _reference(q.bfloat16(), kc, vc, tables, ctx, None)
    assert (out.float() - ref).abs().max().item() < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_independent_of_the_batch(kernel, dtype):
    """A row's result does not depend on which other rows share the call."""
    q, kc, vc, tables, ctx = _case(12, 4, 64, 16, dtype, [7, 64, 200, 1, 30, 9, 12, 80, 44, 3])
    together = kernel(q, kc, vc, tables, ctx, None, 0.125)
    for i in range(len(ctx)):
        alone = kernel(q[i : i + 1], kc, vc, tables[i : i + 1], ctx[i : i + 1], None, 0.125)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_queries_and_tables_read_in_place_from_views(kernel, dtype, cache_dtype):
    """The engine's q is part of the QKV projection's output, [seqs, heads, D]
    with a longer row stride, and its block tables the first columns of a
    wider table: the kernel reads both in place and gives what contiguous
    copies give (the K/V parts next to q and the columns past the view,
    -1 here, are never read)."""
    heads, kv_heads, head_dim = 12, 4, 64
    q, kc, vc, tables, ctx = _case(heads, kv_heads, head_dim, 16, dtype, [1, 16, 17, 50, 33, 64, 5, 2], seed=8)
    ks = vs = None
    if cache_dtype is not None:
        (kc, ks, _), (vc, vs, _) = _quantized(kc.float(), cache_dtype), _quantized(vc.float(), cache_dtype)
    qkv = torch.randn(len(ctx), (heads + 2 * kv_heads) * head_dim).to(dtype)
    view = qkv[:, : heads * head_dim].view(len(ctx), heads, head_dim)
    view.copy_(q)
    assert not view.is_contiguous()
    # The block tables too: the engine passes the used columns of a wider table.
    wide = torch.full((len(ctx), tables.shape[1] + 3), -1, dtype=torch.int64)
    wide[:, : tables.shape[1]] = tables
    out = kernel(view, kc, vc, wide[:, : tables.shape[1]], ctx, None, 0.125, ks, vs)
    assert out.is_contiguous()
    assert torch.equal(out, kernel(q, kc, vc, tables, ctx, None, 0.125, ks, vs))


def test_bad_shapes_are_value_errors(kernel):
    q, kc, vc, tables, ctx = _case(12, 4, 64, 16, torch.float32, [3, 5])
    with pytest.raises(ValueError, match="does not fit"):
        kernel(q[..., :32], kc, vc, tables, ctx, None, 0.125)
    with pytest.raises(ValueError, match="int64"):
        kernel(q, kc, vc, tables.int(), ctx, None, 0.125)


def test_supports_cpu_float_and_quantized_caches():
    assert PagedDecodeKernel.supports(torch.device("cpu"), torch.bfloat16, torch.float32)
    assert PagedDecodeKernel.supports(torch.device("cpu"), torch.bfloat16, torch.int8)
    assert PagedDecodeKernel.supports(torch.device("cpu"), torch.float32, torch.float8_e4m3fn)
    assert not PagedDecodeKernel.supports(torch.device("cuda"), torch.float32, torch.float32)
    assert not PagedDecodeKernel.supports(torch.device("cpu"), torch.int8, torch.int8)
    assert not PagedDecodeKernel.supports(torch.device("cpu"), torch.float32, torch.int16)


def test_without_a_compiler_auto_falls_back_and_native_says_why(monkeypatch, tmp_path):
    from octavo.kernels import build

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    build.clear_loaded()
    try:
        assert paged_decode_kernel() is None
        with pytest.raises(build.KernelBuildError, match="no-such-cc"):
            paged_decode_kernel(required=True)
    finally:
        build.clear_loaded()


def test_build_is_cached_by_source_and_cpu(monkeypatch, tmp_path):
    from octavo.kernels import build

    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    build.clear_loaded()
    try:
        paged_decode_kernel(required=True)
        built = list(tmp_path.glob("kernels/paged_decode-*/libpaged_decode.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        build.clear_loaded()
        paged_decode_kernel(required=True)
        assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        build.clear_loaded()


def _capped_reference(q, keys_of, values_of, lens, window, scale, softcap):
    """Scores times scale, capped to softcap * tanh(score / softcap), softmax, values: in float64."""
    rows = []
    for i, n in enumerate(lens.tolist()):
        start = max(0, n - window) if window is not None else 0
        keys, values = keys_of(i)[start:n].double(), values_of(i)[start:n].double()  # [n, kv_heads, D]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), keys) * scale
        probs = torch.softmax(torch.tanh(scores / softcap) * softcap, dim=-1)
        rows.append(torch.einsum("ht,thd->hd", probs, values))
    return torch.stack(rows)


@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 4, 32, 16, None), (8, 2, 64, 8, 9), (4, 2, 40, 16, None)])
def test_soft_cap(kernel, shape, dtype, cache_dtype):
    """Gemma 2's attention soft cap on every path: bf16 vdpbf16ps (head_dim
    32/64), float32 and head_dim 40 generic, an int8 cache; with a window.
    Queries scaled up so that the cap (2.0) bends most scores."""
    heads, kv_heads, head_dim, block_size, window = shape
    lens = [1, 9, 30, 64, 17]
    q, kc, vc, tables, ctx = _case(heads, kv_heads, head_dim, block_size, dtype, lens, seed=7)
    q = (q.float() * 3).to(dtype)
    scale, softcap = 0.2, 2.0
    if cache_dtype is None:
        kd, vd, ks, vs = kc, vc, None, None
        dense_k, dense_v = kc.float(), vc.float()
    else:
        kd, ks, dense_k = _quantized(kc.float(), cache_dtype)
        vd, vs, dense_v = _quantized(vc.float(), cache_dtype)
    out = kernel(q, kd, vd, tables, ctx, window, scale, ks, vs, softcap=softcap)
    ref = _capped_reference(q, lambda i: dense_k[tables[i]].flatten(0, 1), lambda i: dense_v[tables[i]].flatten(0, 1),
                            ctx, window, scale, softcap)
    uncapped = _capped_reference(q, lambda i: dense_k[tables[i]].flatten(0, 1),
                                 lambda i: dense_v[tables[i]].flatten(0, 1), ctx, window, scale, 1e9)
    diff = (out.double() - ref).abs().max().item()
    # int8: the query in 15 bits (see the test above); measured 1.1e-4 in float32.
    tol = TOL[dtype] if cache_dtype is None else max(TOL[dtype], 1e-3)
    assert diff < tol, f"max abs diff {diff}"
    assert (uncapped - ref).abs().max().item() > 10 * tol  # the cap really changes these numbers


def test_soft_cap_must_be_positive(kernel):
    q, kc, vc, tables, ctx = _case(4, 2, 32, 16, torch.float32, [5])
    with pytest.raises(ValueError, match="softcap"):
        kernel(q, kc, vc, tables, ctx, None, 0.1, softcap=0.0)
