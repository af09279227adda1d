"""Prefill chunks through torch's SDPA, shared by the CPU backends: each
chunk gets its own call with an offset causal mask, reading a cached prefix
by gathering only that request's blocks (dequantized from a quantized cache)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.nn import functional as F

from octavo.attention.base import MaskByWindow, PrefillChunk, StepLayout
from octavo.attention.kv_quant import LayerKVCache, gather_blocks
from octavo.kernels.cpu_features import cpu_target

# On an x86 CPU without AMX, torch's bf16 SDPA multiplies through oneDNN's bf16
# GEMMs, the slow ones on such CPUs (benchmarks/linear_kernels.py), and its
# float32 SDPA through float32 ones. Measured on an Emerald Rapids VM without AMX, 12/4 and 14/2
# heads of 64 (benchmarks/prefill_attention.py): 11-36% less time for chunks
# of 64-2048 tokens, 26-45% more at 32. So chunks of FLOAT32_MIN_QUERY tokens
# and more attend in float32 there; the output is rounded to the model's
# dtype as before (and is closer to the exact one).
FLOAT32_MIN_QUERY = 64


def _x86_without_amx() -> bool:
    target = cpu_target()
    return target.arch == "x86_64" and target.name != "amx"


def attends_in_float32(q: torch.Tensor) -> bool:
    """Whether ``attend`` computes this bf16 chunk (q [B, heads, Q, D]) in float32."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-2] >= FLOAT32_MIN_QUERY
            and _x86_without_amx())


def window_mask(query_pos: torch.Tensor, keys: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """query_pos [Q, 1], keys [K] -> [Q, K]: causal, and within the window if any."""
    mask = keys <= query_pos
    if window is not None:
        mask &= keys > query_pos - window
    return mask


def build_prefills(layout: StepLayout, windows: Iterable[Optional[int]], first: Optional[int] = None
                   ) -> list[PrefillChunk]:
    """One chunk per multi-token request from request ``first`` on (default: every one after the
    decodes), its masks built per window."""
    chunks = []
    for i in range(layout.num_decodes if first is None else first, len(layout.query_lens)):
        start, context = layout.context_lens[i] - layout.query_lens[i], layout.context_lens[i]
        fresh = start == 0
        query_pos = torch.arange(start, context, device=layout.device).unsqueeze(1)
        keys = torch.arange(context, device=layout.device)
        masks: MaskByWindow = {
            # A fresh chunk without a window is exactly the causal square SDPA builds itself.
            w: None if fresh and w is None else window_mask(query_pos, keys, w) for w in windows
        }
        q_start = layout.query_starts[i]
        chunks.append(PrefillChunk(
            q_start=q_start,
            q_end=q_start + layout.query_lens[i],
            context_len=context,
            fresh=fresh,
            block_ids=None if fresh else layout.block_table[i, : layout.blocks_needed[i]],
            masks=masks,
        ))
    return chunks


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """q [B, heads, Q, D] over k, v [B, kv_heads, K, D] (query head h reads
    KV head h // (heads / kv_heads)); ``mask`` broadcast to [B, heads, Q, K],
    True where a query attends; None: the causal square (Q == K). SDPA (in
    float32 where ``attends_in_float32``), except with a soft cap, which SDPA
    cannot apply between the product and the softmax: then the scores are
    formed explicitly, in float32."""
    if softcap is None:
        if attends_in_float32(q):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                 is_causal=mask is None, scale=scale, enable_gqa=True)
            return out.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    b, heads, q_len, d = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    grouped = q.reshape(b, kv_heads, heads // kv_heads * q_len, d)
    scores = (grouped @ k.transpose(-1, -2)).float().view(b, heads, q_len, k_len) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return (probs.view(b, kv_heads, -1, k_len) @ v).view(b, heads, q_len, d)


def attend_prefills(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: LayerKVCache,
    prefills: list[PrefillChunk],
    window: Optional[int],
    out: torch.Tensor,
    scale: float,
    softcap: Optional[float] = None,
) -> None:
    """Each chunk's attention into its rows of ``out`` (``scale`` and
    ``softcap`` as ``AttentionBackend.forward`` takes them)."""
    for chunk in prefills:
        rows = slice(chunk.q_start, chunk.q_end)
        if chunk.fresh:
            keys, values = k[rows], v[rows]
        else:
            # The whole context from the cache (this step's rows are in it by
            # now), dequantized from a quantized one.
            keys = gather_blocks(kv_cache, 0, chunk.block_ids, q.dtype)[: chunk.context_len]
            values = gather_blocks(kv_cache, 1, chunk.block_ids, q.dtype)[: chunk.context_len]
        mask = chunk.masks[window]
        # 4-D inputs: torch's CPU flash kernel takes only those (3-D ones go
        # to the unfused math path: 6x slower on a 64-request offline run).
        o = attend(
            q[rows].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            mask,
            scale,
            softcap,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
