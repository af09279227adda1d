"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3.

Module names mirror Hugging Face checkpoints (``model.layers.0.self_attn.o_proj``
...) so loading is a name match; fused projections (``qkv_proj``, ``gate_up_proj``)
are stacked by the loader from the checkpoint's parts."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from octavo.kernels.fused_ops import FusedOps
from octavo.model.attention_metadata import AttentionMetadata
from octavo.model.config import ArchConfig
from octavo.model.layers.attention import Attention
from octavo.model.layers.linear import Linear
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.switches.mlp_bias)

    def forward(
        self,
        h: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """(this layer's output, the residual stream before it is added):
        each add is done by the next norm (``add_forward``), fused with it."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, max_len: int) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        # Not a buffer: the module may be built on the meta device for loading.
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_len)

    @property
    def attention_windows(self) -> set[Optional[int]]:
        return set(self.arch.layer_windows)

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[T] tokens -> [T, hidden] final hidden states before the last norm
        (``compute_logits`` applies it to the rows that need logits only)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        residual: Optional[torch.Tensor] = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        return h if residual is None else h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def use_fused_ops(self, ops: Optional[FusedOps]) -> None:
        """Run norms, SiLU-and-multiply and rotary with the native kernels
        (``ops``), or with torch ops (None). Same values either way."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, GatedMLP, Attention)):
                module.fused = ops
