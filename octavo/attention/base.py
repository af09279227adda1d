"""The attention seam: a backend turns the step's layout into its metadata
once per step, then runs every layer's attention over the paged KV cache.

The cache of one layer is a ``LayerKVCache`` (kv_quant.py), allocated by the
backend from the layer's ``KVCacheSpec`` (kv_spec.py) when the worker sizes the
pool. The backends here share one layout (``PAGED_KV``): one tensor
``[2, num_blocks, block_size, kv_heads, head_dim]`` (K then V), plus
per-(token, head) scales when it is quantized; a backend with another layout
says so in ``cache_layout`` and allocates, writes and reads its own (the fused
rotary + K/V write of the native elementwise ops writes ``PAGED_KV`` only).
Blocks stay on dim 1 of ``data``, so block copies (copy-on-write) need no
backend. Metadata is an explicit object the model passes down to
each layer, never global state, so two steps (or two models) never share it.
The model calls ``write_kv`` and ``forward`` and never knows which backend runs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Iterable, Optional

import torch

from octavo.attention.kv_quant import LayerKVCache, allocate_layer_cache, write_kv
from octavo.attention.kv_spec import KVCacheSpec

PAGED_KV = "[2, blocks, block_size, kv_heads, head_dim]"
# Rows a request may have to count as short (``StepLayout.num_short``): a speculative step's k + 1 for
# k <= 7. A decode kernel reads the whole context once per row, so longer chunks go to prefill.
SHORT_QUERY = 8
# window (None = full attention) -> mask; True marks keys a query attends to.
MaskByWindow = dict[Optional[int], Optional[torch.Tensor]]


@dataclass
class StepLayout:
    """How the worker laid out one step's tokens, flattened to
    ``[total_tokens, ...]``: request i owns rows ``query_starts[i] ..
    + query_lens[i]``, single-token rows (decodes) first, longest context first,
    then the short requests over a cached context, then the others."""

    block_size: int
    num_decodes: int
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]  # tokens in the cache after this step, per request
    blocks_needed: list[int]  # blocks covering context_lens
    block_table: torch.Tensor  # [requests, max blocks] int64, padded with block 0
    slot_mapping: torch.Tensor  # [total_tokens] int64: block_id * block_size + offset
    device: torch.device
    # The requests right after the decodes whose few rows (2 .. SHORT_QUERY) extend a cached context:
    # speculative verification rows, a prefill's short last chunk. A backend whose decode kernel walks
    # the block tables runs each of their rows as a decode row, so a verified token's logits are those
    # plain decoding would give at that position, bit for bit; the others treat them as prefill chunks.
    num_short: int = 0


@dataclass
class KeyTile:
    """Cached positions ``first .. first + num_keys - 1`` of a prefill chunk's request, read together:
    the blocks holding them (the first one starts at ``first``; the last may run past them)."""

    block_ids: torch.Tensor  # [blocks]
    num_keys: int
    # [q_len, num_keys], True where a query attends; None: every query of the chunk sees every key.
    mask: Optional[torch.Tensor]


@dataclass
class PrefillChunk:
    """Rows ``q_start:q_end`` are positions ``context_len - (q_end - q_start)``
    .. ``context_len - 1`` of one request."""

    q_start: int
    q_end: int
    context_len: int
    # No cached prefix: attend over the step's own K/V and skip the cache read.
    fresh: bool
    # A fresh chunk's masks over itself, [q_len, q_len]; None = plain causal.
    masks: MaskByWindow
    # A chunk after a cached prefix reads its context (its own rows included, in the cache by now) tile by
    # tile, per window: only the keys some query of the chunk sees. Empty when fresh.
    tiles: dict[Optional[int], list[KeyTile]]


@dataclass
class AttentionMetadata:
    """What every backend needs; backends extend it with their own fields."""

    slot_mapping: torch.Tensor  # [total_tokens] int64
    num_decodes: int  # rows 0 .. num_decodes-1 are single-token queries
    prefills: list[PrefillChunk]


class AttentionBackend(ABC):
    """One object serves every layer of a model; ``windows`` are the sliding
    windows its layers use (None = full attention), so masks are built once
    per step per window, never per layer."""

    name: ClassVar[str]
    # What ``supports`` asks for, in words (for the error when it says no).
    requirement: ClassVar[str] = "runs anywhere"
    # Device types on which a decode step can be recorded once and replayed (octavo/worker/decode_graphs.py);
    # such a backend implements ``static_decode_metadata``.
    recorded_on: ClassVar[frozenset[str]] = frozenset()
    cache_layout: ClassVar[str] = PAGED_KV

    def __init__(self, windows: Iterable[Optional[int]]) -> None:
        self.windows = frozenset(windows)

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        """Whether the backend runs a model of ``dtype`` with a cache of ``cache_dtype`` on ``device``."""
        return True

    @classmethod
    def create(cls, windows: Iterable[Optional[int]], required: bool) -> Optional[AttentionBackend]:
        """An instance; None where it cannot be built on this machine (a
        native kernel without a compiler) unless ``required``, then the
        build error is raised."""
        return cls(windows)

    @abstractmethod
    def build_metadata(self, layout: StepLayout) -> AttentionMetadata:
        """Everything the layers' ``forward`` calls need for this step."""

    def static_decode_metadata(self, size: int, max_blocks: int, null_block: int, null_slot: int,
                               max_context: int, device: torch.device) -> AttentionMetadata:
        """Metadata of a decode-only step of ``size`` rows over buffers a recorded step reads every replay
        (octavo/worker/decode_graphs.py): ``slot_mapping`` [size], ``decode_block_table`` [size, max_blocks]
        and ``decode_context_lens`` [size], all rows padding (the null block, context 1) until filled in.
        Backends whose steps cannot be recorded do not override it."""
        raise NotImplementedError(f"the {self.name} attention backend's steps cannot be recorded")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
        window: Optional[int],
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """Causal attention of q [T, heads, D] over each request's cached
        context, within the last ``window`` positions if set. k, v [T,
        kv_heads, D] are this step's, already in ``kv_cache`` (``write_kv``
        or a fused kernel put them there). Scores are q.k * ``scale``
        (default D ** -0.5), then ``softcap * tanh(score / softcap)`` when
        ``softcap`` is set (Gemma 2), before the mask and softmax. Every
        backend honours all of these. Returns [T, heads, D]."""

    def allocate_cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                       static_scales: Optional[torch.Tensor] = None) -> LayerKVCache:
        """A zero-filled cache of ``num_blocks`` blocks for a layer of ``spec`` (``spec.parts`` vectors per
        token and head: K and V, or a latent cache's one); ``static_scales``:
        the checkpoint's [2, kv_heads] K/V scales (quantized caches)."""
        return allocate_layer_cache(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype,
                                    device, static_scales, spec.parts, spec.key_bounds)

    def write_kv(self, kv_cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """k, v [T, kv_heads, D] of this step into the cache (quantized when it is)."""
        write_kv(kv_cache, k, v, meta.slot_mapping)
