"""The self-attention block: projections, optional q/k norm, rotary, paged attention."""
from __future__ import annotations

import torch
from torch import nn

from octavo.model.attention_metadata import AttentionMetadata
from octavo.model.config import ArchConfig
from octavo.model.layers.linear import FusedLinear, Linear
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.paged_attention import paged_attention, write_kv
from octavo.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
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
        q, k, v = self.qkv_proj.forward_split(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, kv_cache, meta, self.window)
        return self.o_proj(out.view(n, self.num_heads * self.head_dim))
