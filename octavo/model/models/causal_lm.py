"""What every decoder-only family shares: the stack (embedding, this pipeline stage's layers, final
norm) and the causal LM around it (rotary tables, pipeline hand-over, logits).

A family subclasses ``CausalLM`` in a file of its own and says what differs: its decoder layer
(``make_layer``), how its config.json is read (``config_reading``), how its checkpoint names and
stores tensors (``packed_modules_mapping``, ``fused_checkpoint``), its norms and embedding scale.
Module names mirror Hugging Face checkpoints (``model.layers.0.self_attn.o_proj`` ...) so loading
is a name match."""
from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch
from torch import nn

from octavo.attention.base import AttentionMetadata
from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.kv_spec import KVCacheSpec
from octavo.distributed.communication import pipeline_recv, pipeline_send
from octavo.distributed.parallel_state import get_parallel_state, stage_layers
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig, ConfigReading
from octavo.model.layers.attention import Attention
from octavo.model.layers.norm import RMSNorm
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


class DecoderLayer(Protocol):
    """One layer of the stack: (its output, the residual stream before it is added); each add is
    done by the next norm, fused with it. ``rope_index``: which of the model's rotary tables it reads;
    ``self_attn``: its attention block, which declares the layer's KV cache."""

    rope_index: int
    self_attn: Attention

    def __call__(self, h: torch.Tensor, residual: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: LayerKVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecoderStack(nn.Module):
    """``model.*`` of a checkpoint. Layers of other pipeline stages are empty placeholders, so that
    the ones here keep their checkpoint names (model.layers.<global index>)."""

    def __init__(self, arch: ArchConfig, layer_range: range, layers: list[nn.Module], norm: RMSNorm,
                 embed_scale: Optional[float] = None) -> None:
        super().__init__()
        self.layer_range = layer_range
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.embed_scale = embed_scale
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


class CausalLM(nn.Module):
    # Checkpoint module name -> (this model's fused module, the part's shard id).
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Whether checkpoints store the fused modules whole (split into their parts on load).
    fused_checkpoint = False
    # Substrings of checkpoint tensor names -> what this model calls them.
    checkpoint_renames: dict[str, str] = {}

    @classmethod
    def config_reading(cls, raw: dict[str, Any]) -> ConfigReading:
        """How this family reads the parts of config.json where families differ."""
        return ConfigReading()

    def make_layer(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        """Decoder layer ``layer_idx`` (a ``DecoderLayer``)."""
        raise NotImplementedError

    def make_norm(self, arch: ArchConfig, dim: int, backends: ModelBackends) -> RMSNorm:
        return RMSNorm(dim, arch.rms_norm_eps, backends.ops)

    def embed_scale(self, arch: ArchConfig) -> Optional[float]:
        """A factor on the embeddings (Gemma: sqrt(hidden_size)); None: none."""
        return None

    def __init__(self, arch: ArchConfig, max_len: int, backends: ModelBackends, lm_head: bool = True) -> None:
        """``lm_head`` False: an embedding model, which needs the final norm's
        output only (``final_hidden``), not logits."""
        super().__init__()
        self.arch = arch
        state = get_parallel_state()
        here = stage_layers(arch.num_layers, state)
        layers = [self.make_layer(arch, i, backends) if i in here else nn.Module() for i in range(arch.num_layers)]
        self.model = DecoderStack(arch, here, layers, self.make_norm(arch, arch.hidden_size, backends),
                                  self.embed_scale(arch))
        self.lm_head: Optional[ParallelLMHead] = None
        if lm_head:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, backends.linear_method("lm_head"),
                                          "lm_head")
            if arch.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)
        # One table per distinct rope (index 1: Gemma 3's sliding layers').
        self.rotaries = [RotaryEmbedding(rope, arch.head_dim, max_len)
                         for rope in (arch.rope, arch.local_rope) if rope is not None]
        self.first_stage = state.pp_rank == 0
        self.last_stage = state.pp_rank == state.pp_size - 1

    @property
    def local_layers(self) -> list[nn.Module]:
        """This pipeline stage's layers, in order (all of them without pipelining)."""
        r = self.model.layer_range
        return list(self.model.layers[r.start : r.stop])

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """What each layer of this stage keeps per token, in order (the worker allocates a cache per layer)."""
        return [layer.self_attn.kv_cache_spec(block_size, dtype) for layer in self.local_layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metas: Sequence[AttentionMetadata],
    ) -> Optional[torch.Tensor]:
        """[T] tokens -> [T, hidden] final hidden states before the last norm
        (``compute_logits`` applies it to the rows that need logits only).
        ``kv_caches`` and ``metas``: one per layer of this stage (layers of one
        KV cache group share their metadata, octavo/attention/kv_groups.py). Under pipeline
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
        for layer, kv_cache, meta in zip(self.local_layers, kv_caches, metas):
            cos, sin = tables[layer.rope_index]
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        if not self.last_stage:
            pipeline_send([h, residual])
            return None
        return h if residual is None else h + residual

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits of ``hidden``'s rows; None on a tensor-parallel rank other
        than the driver (the vocabulary shards are gathered on the driver only).
        A final soft cap (Gemma 2) applies to the gathered logits."""
        logits = self.lm_head(self.final_hidden(hidden))
        cap = self.arch.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output: transformers' ``last_hidden_state``."""
        return self.model.norm(hidden)
