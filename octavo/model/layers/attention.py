"""The self-attention block: q/k/v column-parallel by heads, optional q/k
norm, rotary (whole heads or their leading part), the attention backend over
the paged cache (per layer: window, softmax scale, soft cap), o_proj
row-parallel (one all-reduce for the block under tensor parallelism)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from octavo.attention.base import PAGED_KV, AttentionMetadata
from octavo.attention.kv_spec import KVCacheSpec, SlidingWindowSpec
from octavo.attention.kv_quant import LayerKVCache
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig
from octavo.model.layers.linear import QKVParallelLinear, RowParallelLinear
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding, rotary_dim


@dataclass(frozen=True)
class AttentionOptions:
    """Where families' self-attention blocks differ (the model class says)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary
    unit_offset_norm: bool = False  # those norms scale by (1 + weight) (Gemma)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends, prefix: str,
                 options: AttentionOptions) -> None:
        """``prefix``: the block's module path (``model.layers.0.self_attn``)."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, options.qkv_bias,
            backends.linear_method(f"{prefix}.qkv_proj"), f"{prefix}.qkv_proj",
        )
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, options.o_bias,
                                        backends.linear_method(f"{prefix}.o_proj"), f"{prefix}.o_proj")
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, backends.ops, options.unit_offset_norm)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, backends.ops, options.unit_offset_norm)
        self.window = arch.layer_windows[layer_idx]
        self.scale = arch.attention_scale if arch.attention_scale is not None else self.head_dim**-0.5
        self.softcap = arch.attn_logit_softcap
        self.backend = backends.attention
        # A fused rotary also writes K/V into the cache, in the paged layout
        # only; q/k norm must run before rotary, so not then, and it rotates
        # whole heads, so not with partial rotary either.
        partial = rotary_dim(arch.layer_rope(layer_idx), self.head_dim) < self.head_dim
        self.ops = backends.ops
        self.fused_rotary = (backends.ops.fuses_rotary_write and self.backend.cache_layout == PAGED_KV
                             and not (options.qk_norm or partial))

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What this layer keeps per token: this rank's KV heads, in a cache of ``dtype``."""
        if self.window is None:
            return KVCacheSpec(block_size, self.num_kv_heads, self.head_dim, dtype)
        return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_dim, dtype, self.window)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.fused_rotary and (kv_cache.dtype == x.dtype or kv_cache.quantized):
            # Rotary in place on the projection's output, K/V straight into
            # their slots (quantized there when the cache is).
            slots = kv_cache.slots()
            self.ops.rotary_write_kv(
                qkv, self.num_heads, self.num_kv_heads, cos.view(n, -1), sin.view(n, -1), slots[0], slots[1],
                meta.slot_mapping, kv_cache.scales, kv_cache.static_scales,
            )
            q, k, v = self._heads(qkv)
        else:
            q, k, v = self._heads(qkv)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q = RotaryEmbedding.apply(q, cos, sin)
            k = RotaryEmbedding.apply(k, cos, sin)
            self.backend.write_kv(kv_cache, k, v, meta)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.window, self.scale, self.softcap)
        return self.o_proj(out.view(n, self.num_heads * self.head_dim))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        n = q.shape[0]
        return (q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                v.view(n, self.num_kv_heads, self.head_dim))
