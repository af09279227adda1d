"""Prefill chunks, shared by the backends. A fresh chunk (no cached prefix)
attends over the step's own K/V in one call. A chunk after a cached prefix
reads its context from the paged cache one tile of ``KEY_TILE`` keys at a
time, attends over each tile, and merges the tiles' softmaxes by their
log-sum-exp, as flash attention merges its blocks: what a layer allocates
depends on the chunk and the tile, never on the context's length. A
2048-token chunk at position 128k reads 32 tiles of 4096 keys instead of a
128k-key copy of K and V and a [2048, 128k] mask (which SDPA turned into
floats: 1 GiB per layer)."""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch.nn import functional as F

from octavo.attention.base import KeyTile, MaskByWindow, PrefillChunk, StepLayout
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
# Keys of the cached context read per attention call. A tile's K and V are 2 MiB at Qwen2.5-0.5B's 2 KV
# heads of 64 in bf16; a tile's mask (only where the chunk's own rows or a window's edge fall in it) is
# [chunk, KEY_TILE]. Each tile costs one kernel call and one merge, both small next to its products.
KEY_TILE = 4096
# Where scores are formed explicitly (soft cap, value heads of another size, devices without the fused
# kernel), query rows per product: the scores stay [heads, EXPLICIT_ROWS, keys of one tile or chunk].
EXPLICIT_ROWS = 64

# (out [heads, Q, Dv] float32, log-sum-exp of each row's scores [heads, Q] float32; -inf: no key seen)
Partial = tuple[torch.Tensor, torch.Tensor]
# A tile -> its keys and values [kv_heads, num_keys, D] (the backend reads blocks; latent attention decompresses).
TileReader = Callable[[KeyTile], tuple[torch.Tensor, torch.Tensor]]


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
    decodes), its masks or tiles built per window."""
    chunks = []
    for i in range(layout.num_decodes if first is None else first, len(layout.query_lens)):
        q_len, context = layout.query_lens[i], layout.context_lens[i]
        start = context - q_len
        fresh = start == 0
        query_pos = torch.arange(start, context, device=layout.device).unsqueeze(1)
        masks: MaskByWindow = {}
        tiles: dict[Optional[int], list[KeyTile]] = {}
        for w in windows:
            if not fresh:
                tiles[w] = _context_tiles(layout.block_table[i], layout.block_size, start, query_pos, w)
            elif w is None or w >= q_len:
                masks[w] = None  # the causal square SDPA builds itself: the window reaches past the chunk
            else:
                masks[w] = window_mask(query_pos, query_pos.view(-1), w)
        q_start = layout.query_starts[i]
        chunks.append(PrefillChunk(q_start, q_start + q_len, context, fresh, masks, tiles))
    return chunks


def _context_tiles(table: torch.Tensor, block_size: int, start: int, query_pos: torch.Tensor,
                   window: Optional[int]) -> list[KeyTile]:
    """The keys the queries at ``query_pos`` [Q, 1] (``start`` ..) see, in tiles of whole blocks of
    ``table``. Keys before the window of the first query are never read (a window group's table
    holds no block there any more); a tile gets a mask only where some query does not see some key:
    the chunk's own rows (causal), and keys the last query has left behind its window."""
    context = start + query_pos.shape[0]
    first_key = 0 if window is None else max(0, start - window + 1)
    per_tile = max(1, KEY_TILE // block_size)
    end_block = -(-context // block_size)
    tiles = []
    for b in range(first_key // block_size, end_block, per_tile):
        lo, hi = b * block_size, min((b + per_tile) * block_size, context)
        partial = hi - 1 > start or (window is not None and lo < context - window)
        mask = window_mask(query_pos, torch.arange(lo, hi, device=query_pos.device), window) if partial else None
        tiles.append(KeyTile(table[b : min(b + per_tile, end_block)], hi - lo, mask))
    return tiles


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


def attend_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                   softcap: Optional[float]) -> Partial:
    """q [heads, Q, D] over one tile k [kv_heads, K, D], v [kv_heads, K, Dv] (``mask`` [Q, K], True where
    a query attends; None: all of them) -> its ``Partial``. Through torch's fused CPU flash kernel
    where it applies (it returns the log-sum-exp that SDPA drops), else with explicit scores."""
    fused = q.device.type == "cpu" and softcap is None and q.shape[-1] == v.shape[-1]
    if not fused:
        return _explicit_partial(q, k, v, mask, scale, softcap)
    dtype = torch.float32 if attends_in_float32(q) else q.dtype
    # The kernel takes an additive mask of the query's dtype only.
    bias = None if mask is None else torch.zeros(mask.shape, dtype=dtype, device=q.device).masked_fill_(
        ~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0).to(dtype), k.unsqueeze(0).to(dtype), v.unsqueeze(0).to(dtype), 0.0, False,
        attn_mask=bias, scale=scale)
    lse = lse[0]
    if mask is not None:
        # The kernel reports a row that sees no key as out 0, log-sum-exp 0: it must weigh nothing.
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out[0].float(), lse


def _explicit_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                      scale: float, softcap: Optional[float]) -> Partial:
    """``attend_partial`` in float32 with the scores formed (and soft-capped) explicitly, EXPLICIT_ROWS
    query rows at a time."""
    heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[0], k.shape[1]
    group = heads // kv_heads
    keys, values = k.float().transpose(1, 2), v.float()
    out = torch.empty(heads, q_len, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(heads, q_len, dtype=torch.float32, device=q.device)
    for r in range(0, q_len, EXPLICIT_ROWS):
        rows = slice(r, min(q_len, r + EXPLICIT_ROWS))
        n = rows.stop - r
        scores = (q[:, rows].float().reshape(kv_heads, group * n, -1) @ keys).view(heads, n, k_len) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores.masked_fill_(~mask[rows], float("-inf"))
        part = torch.logsumexp(scores, dim=-1)
        # A row that sees no key: exp(-inf - -inf) is NaN; it weighs nothing.
        probs = torch.exp(scores - part.unsqueeze(-1)).nan_to_num_(0.0)
        out[:, rows] = (probs.view(kv_heads, group * n, k_len) @ values).view(heads, n, -1)
        lse[:, rows] = part
    return out, lse


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Two partial attentions of the same queries over disjoint keys -> the attention over both."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    # Rows neither part has seen a key of keep lse -inf (and weights NaN -> 0).
    weight_a = torch.exp(lse_a - lse).nan_to_num_(0.0).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).nan_to_num_(0.0).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def attend_tiles(q: torch.Tensor, tiles: list[KeyTile], read: TileReader, scale: float,
                 softcap: Optional[float]) -> torch.Tensor:
    """q [heads, Q, D] over a chunk's context, ``read`` giving each tile's keys and values ->
    [heads, Q, Dv] float32."""
    def part(tile: KeyTile) -> Partial:
        return attend_partial(q, *read(tile), tile.mask, scale, softcap)

    merged = part(tiles[0])  # a chunk after a cached prefix always has its own rows to read
    for tile in tiles[1:]:
        merged = merge_partials(merged, part(tile))
    return merged[0]


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

    def read(tile: KeyTile) -> tuple[torch.Tensor, torch.Tensor]:
        # Dequantized from a quantized cache; [kv_heads, keys, D].
        return tuple(gather_blocks(kv_cache, which, tile.block_ids, q.dtype)[: tile.num_keys].transpose(0, 1)
                     for which in (0, 1))

    for chunk in prefills:
        rows = slice(chunk.q_start, chunk.q_end)
        if chunk.fresh:
            # 4-D inputs: torch's CPU flash kernel takes only those (3-D ones go
            # to the unfused math path: 6x slower on a 64-request offline run).
            o = attend(q[rows].transpose(0, 1).unsqueeze(0), k[rows].transpose(0, 1).unsqueeze(0),
                       v[rows].transpose(0, 1).unsqueeze(0), chunk.masks[window], scale, softcap).squeeze(0)
        else:
            o = attend_tiles(q[rows].transpose(0, 1), chunk.tiles[window], read, scale, softcap)
        out[rows] = o.transpose(0, 1)
