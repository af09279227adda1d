"""The self-attention block: projections, optional q/k norm, rotary, paged attention."""
from __future__ import annotations

import torch
from torch import nn

from typing import Optional

from octavo.kernels.fused_ops import FusedOps
from octavo.model.attention_metadata import AttentionMetadata
from octavo.model.config import ArchConfig
from octavo.model.layers.linear import FusedLinear, Linear
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.paged_attention import paged_attention, write_kv
from octavo.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    # The native kernels (set by ``use_fused_ops``); None: torch ops.
    fused: Optional[FusedOps] = None

    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        sw = arch.switches
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(
            arch.hidden_size, [self.num_heads * self.head_dim, kv_size, kv_size], ("q_proj", "k_proj", "v_proj"),
            bias=sw.qkv_bias,
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=sw.o_bias)
        self.qk_norm = sw.qk_norm
        if sw.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.window = arch.layer_windows[layer_idx]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        if self.fused is not None and not self.qk_norm and kv_cache.dtype == x.dtype:
            # Rotary in place on the projection's output, K/V straight into their slots.
            qkv = self.qkv_proj(x)
            slots = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
            self.fused.rotary_write_kv(
                qkv, self.num_heads, self.num_kv_heads, cos.view(n, -1), sin.view(n, -1), slots[0], slots[1],
                meta.slot_mapping,
            )
            q, k, v = self._heads(qkv.split(self.qkv_proj.sizes, dim=-1))
        else:
            q, k, v = self._heads(self.qkv_proj.forward_split(x))
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q = RotaryEmbedding.apply(q, cos, sin)
            k = RotaryEmbedding.apply(k, cos, sin)
            write_kv(kv_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, kv_cache, meta, self.window)
        return self.o_proj(out.view(n, self.num_heads * self.head_dim))

    def _heads(self, qkv: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv
        n = q.shape[0]
        return (q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                v.view(n, self.num_kv_heads, self.head_dim))
