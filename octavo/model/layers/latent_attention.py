"""Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one latent vector per
token (``kv_a_proj_with_mqa``, normed) and a rotary key every head shares, so the cache keeps that
vector only (``LatentKVCacheSpec``): kv_lora_rank + qk_rope_head_dim values per token and layer.

Two ways to attend over it, the same product regrouped:

- prefill chunks decompress their context: ``kv_b_proj`` turns each latent into every head's
  unrotated key part and value, and the chunk attends as ordinary attention does (one SDPA call);
- decode rows absorb the up-projection instead: a head's score q_nope . (W_UK c) is
  (q_nope W_UK) . c, so the query moves into latent space, the heads attend over the cached
  latents as over a single shared K/V head (multi-query attention, by the backend's own decode
  over the paged blocks, in place), and the output leaves through W_UV. A decode step then
  reads kv_lora_rank + qk_rope_head_dim values per cached token instead of decompressing the
  whole context every step.

Under tensor parallelism each rank holds its heads' slices of the query, kv_b_proj and o_proj
(column / row parallel) and the whole latent cache (every head reads it).

An int8 / fp8 cache (``kv_cache_dtype``) holds each entry with one scale per token (kv_spec.py): prefill
chunks over a cached context decompress its dequantized latents, the decode kernels dequantize as they read;
a fresh chunk attends over its own entries as computed, as K/V attention does."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from octavo.attention.base import AttentionMetadata, PrefillChunk
from octavo.attention.kv_quant import LayerKVCache, gather_blocks, write_vectors
from octavo.attention.kv_spec import LatentKVCacheSpec
from octavo.attention.prefill import attend, attend_tiles
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig
from octavo.model.layers.latent_up_projection import HEAD_KERNEL_ROWS, HeadProducts, LatentUpProjectionMethod
from octavo.model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding, yarn_mscale

# The q_a and kv_a norms keep RMSNorm's default epsilon whatever rms_norm_eps says (as trained).
LATENT_NORM_EPS = 1e-6


def latent_softmax_scale(arch: ArchConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the rope is
    scaled: the stretch corrects every dim of q.k, not only the rotary ones cos/sin scale."""
    mla = arch.latent_attention
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    rope = arch.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends, prefix: str) -> None:
        """``prefix``: the block's module path (``model.layers.0.self_attn``)."""
        super().__init__()
        mla = arch.latent_attention
        if mla is None:
            raise ValueError(f"{arch.architecture}: latent attention needs its config (kv_lora_rank ...)")
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        bias = arch.attention_bias
        self.q_lora = mla.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(arch.hidden_size, mla.q_lora_rank, bias,
                                             backends.linear_method(f"{prefix}.q_a_proj"), f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, backends.ops)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, arch.num_heads * qk_dim, False,
                                                 backends.linear_method(f"{prefix}.q_b_proj"), f"{prefix}.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(arch.hidden_size, arch.num_heads * qk_dim, False,
                                               backends.linear_method(f"{prefix}.q_proj"), f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            arch.hidden_size, self.kv_lora_rank + self.rope_dim, bias,
            backends.linear_method(f"{prefix}.kv_a_proj_with_mqa"), f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, backends.ops)
        # Kept a plain float product whatever the quantization: decode multiplies by its two halves
        # (W_UK, W_UV) directly, so their weights must stay readable as they are stored.
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, arch.num_heads * (self.nope_dim + self.v_dim),
                                              False, LatentUpProjectionMethod(self.nope_dim, self.v_dim),
                                              f"{prefix}.kv_b_proj")
        self.num_heads = self.kv_b_proj.output_sizes[0] // (self.nope_dim + self.v_dim)  # this rank's
        self.o_proj = RowParallelLinear(arch.num_heads * self.v_dim, arch.hidden_size, bias,
                                        backends.linear_method(f"{prefix}.o_proj"), f"{prefix}.o_proj")
        self.rotate = RotaryEmbedding.apply_interleaved if mla.rope_interleave else RotaryEmbedding.apply
        self.scale = latent_softmax_scale(arch)
        self.backend = backends.attention

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> LatentKVCacheSpec:
        """One latent vector and one rotary key per token, shared by every head (and rank)."""
        return LatentKVCacheSpec(block_size, 1, self.kv_lora_rank + self.rope_dim, dtype, rope_dim=self.rope_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: LayerKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(n, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        # [n, 1, kv_lora_rank + rope]: what the cache keeps, in its slots as one "head".
        entry = torch.cat((self.kv_a_layernorm(latent.contiguous()).unsqueeze(1),
                           self.rotate(k_rope.unsqueeze(1), cos, sin)), dim=-1)
        write_vectors(kv_cache, (entry,), meta.slot_mapping)
        q_rope = self.rotate(q_rope, cos, sin)
        out = x.new_empty(n, self.num_heads, self.v_dim)
        d = meta.num_decodes
        if d:
            out[:d] = self.absorbed_decode(q_nope[:d], q_rope[:d], kv_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.q_start, chunk.q_end)
            out[rows] = self.decompressed_prefill(q_nope[rows], q_rope[rows], entry[rows], kv_cache, chunk)
        return self.o_proj(out.view(n, self.num_heads * self.v_dim))

    def _per_head(self, x: torch.Tensor, keys: bool) -> torch.Tensor:
        """x [rows, heads, in] times each head's half of kv_b_proj: W_UK with ``keys`` (q_nope [.., nope] into
        latent space [.., kv_lora_rank]), else W_UV (a latent output [.., kv_lora_rank] to values [.., v]); by the
        experts kernel on its per-head copies up to HEAD_KERNEL_ROWS rows, else by torch.bmm on views of the
        loaded weight (latent_up_projection.py has the timings)."""
        heads: Optional[HeadProducts] = self.kv_b_proj.prepared
        if heads is not None and x.shape[0] <= HEAD_KERNEL_ROWS:
            return heads.multiply(x, heads.keys if keys else heads.values)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        return torch.bmm(x.transpose(0, 1), w_uk if keys else w_uv.transpose(1, 2)).transpose(0, 1)

    def absorbed_decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: LayerKVCache,
                        meta: AttentionMetadata) -> torch.Tensor:
        """The decode rows' attention [rows, heads, v] without decompressing their contexts: queries
        [rows, heads, kv_lora_rank + rope] against the cached latents as one K/V head, through
        the backend's decode (the native kernel reads the blocks in place)."""
        query = torch.cat((self._per_head(q_nope, keys=True), q_rope), dim=-1)
        # K and V are both the latent (the value's last rope dims come out and are dropped): views, no copy.
        scales = None if kv_cache.scales is None else kv_cache.scales.expand(2, -1, -1, -1)
        shared = LayerKVCache(kv_cache.data.expand(2, -1, -1, -1, -1), scales)
        decodes = replace(meta, prefills=[]) if meta.prefills else meta
        o = self.backend.forward(query, query[:, :1], query[:, :1], shared, decodes, None, self.scale)
        return self._per_head(o[..., : self.kv_lora_rank], keys=False)

    def decompressed_prefill(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entry: torch.Tensor,
                             kv_cache: LayerKVCache, chunk: PrefillChunk) -> torch.Tensor:
        """One prefill chunk's attention [rows, heads, v] over its context decompressed into every
        head's keys and values: this step's ``entry`` rows when the chunk is the whole context, else
        the cached latents of its blocks (the chunk's own rows are among them by now), one tile at a
        time, so only a tile is ever decompressed."""
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)

        def decompress(latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """[n, kv_lora_rank + rope] -> keys [heads, n, nope + rope], values [heads, n, v]."""
            latent, k_rope = latents.split((self.kv_lora_rank, self.rope_dim), dim=-1)
            kv = self.kv_b_proj(latent).view(-1, self.num_heads, self.nope_dim + self.v_dim)
            k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)
            k = torch.cat((k_nope, k_rope.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
            return k.transpose(0, 1), v.transpose(0, 1)

        if chunk.fresh:
            k, v = decompress(entry[:, 0])
            o = attend(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), chunk.masks[None], self.scale, None)[0]
        else:
            o = attend_tiles(q, chunk.tiles[None], lambda tile: decompress(
                gather_blocks(kv_cache, 0, tile.block_ids, q.dtype)[: tile.num_keys, 0]), self.scale, None)
            o = o.to(q.dtype)
        return o.transpose(0, 1)
