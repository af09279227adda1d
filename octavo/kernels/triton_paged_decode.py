"""Paged decode attention in Triton, for CUDA: each (sequence, KV head, partition of its context) program walks its
part of the block table and reads K/V in place, as the CPU C kernel does; a second kernel merges the partitions.

Splitting a long context into partitions (flash-decoding) keeps a GPU's many cores busy at small batches: batch 1
with 8 KV heads would otherwise run 8 programs. The merge is a second, small launch even for one partition, so
the launches do not depend on the contexts' lengths (a captured CUDA graph replays them unchanged).

One program serves all query heads of its KV head (GQA), so every K/V element is read once per step. Scores and
sums are float32; a quantized cache (int8/fp8 values with a float32 scale per token and head) is dequantized as it
is read. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (the tests do; it is slow).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Tokens of context per program; a multiple of any block size used (16 by default).
PARTITION_TOKENS = 512
# tl.dot needs every dimension of at least 16 on GPUs.
_MIN_DOT = 16


@triton.jit
def _tanh(x):
    # tl has no tanh that runs both compiled and interpreted; 1 - 2 / (e^2x + 1) is exact at both ends.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _decode_partition(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, lens_ptr,
    out_ptr, max_ptr, sum_ptr,
    scale, window, softcap,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_sb, stride_sh,
    stride_bt,
    stride_ot, stride_oh, stride_op,
    stride_mt, stride_mh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr, PARTITION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, QUANTIZED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context = tl.load(lens_ptr + seq)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context - window, 0)
    part_start = part * PARTITION
    part_end = tl.minimum(part_start + PARTITION, context)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s = tl.arange(0, BLOCK_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # Blocks of this partition that hold positions inside the window; a partition wholly before the window or
    # past the context runs no iteration and leaves a zero sum, which the merge weighs as nothing.
    start = tl.maximum(part_start, first)
    for b in range(start // BLOCK_SIZE, (part_end + BLOCK_SIZE - 1) // BLOCK_SIZE):
        block = tl.load(table_ptr + seq * stride_bt + b)
        pos = b * BLOCK_SIZE + s
        live = (s < BLOCK_SIZE) & (pos >= start) & (pos < part_end)
        offsets = block * stride_cb + s[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        mask = live[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if QUANTIZED:
            scale_offsets = block * stride_sb + kv_head * stride_sh + s
            k = k * tl.load(k_scale_ptr + scale_offsets, mask=live, other=0.0)[:, None]
            v = v * tl.load(v_scale_ptr + scale_offsets, mask=live, other=0.0)[:, None]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if HAS_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        scores = tl.where(live[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        alpha = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        running_max = new_max

    out_offsets = seq * stride_ot + heads[:, None] * stride_oh + part * stride_op + d[None, :]
    tl.store(out_ptr + out_offsets, acc / tl.maximum(running_sum, 1e-30)[:, None],
             mask=head_ok[:, None] & dim_ok[None, :])
    stats = seq * stride_mt + heads * stride_mh + part
    tl.store(max_ptr + stats, running_max, mask=head_ok)
    tl.store(sum_ptr + stats, running_sum, mask=head_ok)


@triton.jit
def _merge_partitions(
    part_ptr, max_ptr, sum_ptr, out_ptr,
    stride_pt, stride_ph, stride_pp,
    stride_mt, stride_mh,
    stride_ot, stride_oh,
    NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, PARTS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    part_ok = p < NUM_PARTS
    maxes = tl.load(max_ptr + seq * stride_mt + head * stride_mh + p, mask=part_ok, other=float("-inf"))
    sums = tl.load(sum_ptr + seq * stride_mt + head * stride_mh + p, mask=part_ok, other=0.0)
    overall = tl.max(maxes, 0)
    # Empty partitions have max -inf and sum 0: their weight is 0 (exp(-inf) = 0).
    weights = tl.where(sums > 0, sums * tl.exp(maxes - overall), 0.0)
    parts = tl.load(part_ptr + seq * stride_pt + head * stride_ph + p[:, None] * stride_pp + d[None, :],
                    mask=part_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _pad(n: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(n))


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    key_scales: Optional[torch.Tensor] = None,
    value_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q [n, heads, D]; key/value_cache [num_blocks, block_size, kv_heads, D] (float, or int8/fp8 with
    key/value_scales [num_blocks, kv_heads, block_size] float32); block_table [n, max_blocks] int; context_lens
    [n] int (tokens in the cache, this step's included); ``max_context_len`` bounds them (it sizes the grid, so a
    captured CUDA graph can pass its capacity). Returns [n, heads, D] in q's dtype."""
    n, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    num_parts = max(1, triton.cdiv(max_context_len, PARTITION_TOKENS))
    partials = torch.empty(n, heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    maxes = torch.empty(n, heads, num_parts, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    quantized = key_scales is not None
    scale_strides = (key_scales.stride(0), key_scales.stride(1)) if quantized else (0, 0)
    _decode_partition[(n, kv_heads, num_parts)](
        q, key_cache, value_cache,
        key_scales if quantized else key_cache, value_scales if quantized else value_cache,
        block_table, context_lens, partials, maxes, sums,
        scale, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        *scale_strides,
        block_table.stride(0),
        partials.stride(0), partials.stride(1), partials.stride(2),
        maxes.stride(0), maxes.stride(1),
        GROUP=group, GROUP_PAD=_pad(group), HEAD_DIM=head_dim, HEAD_DIM_PAD=_pad(head_dim),
        BLOCK_SIZE=block_size, BLOCK_PAD=_pad(block_size), PARTITION=PARTITION_TOKENS,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, QUANTIZED=quantized,
    )
    out = torch.empty_like(q)
    _merge_partitions[(n, heads)](
        partials, maxes, sums, out,
        partials.stride(0), partials.stride(1), partials.stride(2),
        maxes.stride(0), maxes.stride(1),
        out.stride(0), out.stride(1),
        NUM_PARTS=num_parts, PARTS_PAD=triton.next_power_of_2(num_parts),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return out
