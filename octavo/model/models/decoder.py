"""The decoder-only transformer shared by Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 and Phi-3; the registry's switches say where they differ.

Module names mirror Hugging Face checkpoints (``model.layers.0.self_attn.o_proj``
...) so loading is a name match; the fused projections (``qkv_proj``,
``gate_up_proj``) take their parts' tensors through ``packed_modules_mapping``
(Phi-3 stores them fused; the loader splits them into those parts)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from octavo.attention.base import AttentionMetadata
from octavo.attention.kv_quant import LayerKVCache
from octavo.distributed.communication import pipeline_recv, pipeline_send
from octavo.distributed.parallel_state import get_parallel_state, stage_layers
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig
from octavo.model.layers.attention import Attention
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> None:
        super().__init__()
        ops, sw = backends.fused_ops, arch.switches

        def norm() -> RMSNorm:
            return RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops, sw.gemma_norm)

        self.input_layernorm = norm()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = Attention(arch, layer_idx, backends, f"{prefix}.self_attn")
        # Without sandwich norms this one is the MLP's input norm; with them
        # (Gemma) it normalises the attention output, pre_feedforward_layernorm
        # the MLP's input and post_feedforward_layernorm its output.
        self.post_attention_layernorm = norm()
        self.sandwich = sw.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, sw.mlp_bias,
                            backends, f"{prefix}.mlp")
        # Which of the model's rotary tables this layer reads (Gemma 3's sliding layers: their own).
        self.rope_index = int(arch.layer_rope(layer_idx) is not arch.rope)

    def forward(
        self,
        h: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added):
        each add is done by the next norm (``add_forward``), fused with it."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm.add_forward(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, arch: ArchConfig, backends: ModelBackends) -> None:
        super().__init__()
        state = get_parallel_state()
        self.layer_range = stage_layers(arch.num_layers, state)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        # Layers of other pipeline stages are empty placeholders, so that the
        # ones here keep their checkpoint names (model.layers.<global index>).
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, backends) if i in self.layer_range else nn.Module() for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backends.fused_ops, arch.switches.gemma_norm)
        # Gemma multiplies the embeddings by sqrt(hidden_size) rounded to the model dtype.
        self.embed_scale = arch.hidden_size**0.5 if arch.switches.scale_embeddings else None
        # ... as a tensor per dtype, made once: a recorded decode step refuses tensors made from Python values.
        self._embed_scales: dict[torch.dtype, torch.Tensor] = {}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            scale = self._embed_scales.get(h.dtype)
            if scale is None:
                scale = self._embed_scales[h.dtype] = torch.tensor(self.embed_scale, dtype=h.dtype)
            h = h * scale
        return h


class DecoderForCausalLM(nn.Module):
    # Checkpoint module name -> (this model's fused module, the part's shard id).
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: ArchConfig, max_len: int, backends: ModelBackends, lm_head: bool = True) -> None:
        """``lm_head`` False: an embedding model, which needs the final norm's
        output only (``final_hidden``), not logits."""
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch, backends)
        self.lm_head: Optional[ParallelLMHead] = None
        if lm_head:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, backends.linear_method("lm_head"),
                                          "lm_head")
            if arch.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)
        # One table per distinct rope (index 1: Gemma 3's sliding layers').
        self.rotaries = [RotaryEmbedding(rope, arch.head_dim, max_len)
                         for rope in (arch.rope, arch.local_rope) if rope is not None]
        state = get_parallel_state()
        self.first_stage = state.pp_rank == 0
        self.last_stage = state.pp_rank == state.pp_size - 1

    @property
    def local_layers(self) -> list[DecoderLayer]:
        """This pipeline stage's layers, in order (all of them without pipelining)."""
        r = self.model.layer_range
        return list(self.model.layers[r.start : r.stop])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[T] tokens -> [T, hidden] final hidden states before the last norm
        (``compute_logits`` applies it to the rows that need logits only).
        ``kv_caches``: one per layer of this stage. Under pipeline
        parallelism a stage past the first receives the hidden state and the
        residual stream from the previous stage, and a stage before the last
        sends them on and returns None."""
        if self.first_stage:
            h = self.model.embed(input_ids)
            residual: Optional[torch.Tensor] = None
        else:
            shape = (input_ids.shape[0], self.arch.hidden_size)
            h, residual = pipeline_recv(2, shape, self.model.norm.weight.dtype, input_ids.device)
        tables = [rotary.cos_sin(positions, h.dtype) for rotary in self.rotaries]
        for layer, kv_cache in zip(self.local_layers, kv_caches):
            cos, sin = tables[layer.rope_index]
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        if not self.last_stage:
            pipeline_send([h, residual])
            return None
        return h if residual is None else h + residual

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits of ``hidden``'s rows; None on a tensor-parallel rank other
        than the driver (the vocabulary shards are gathered on the driver only).
        Gemma 2's final soft cap applies to the gathered logits."""
        logits = self.lm_head(self.final_hidden(hidden))
        cap = self.arch.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output: transformers' ``last_hidden_state``."""
        return self.model.norm(hidden)
