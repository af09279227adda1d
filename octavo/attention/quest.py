"""Quest: query-aware sparse attention for decode (Tang et al., 2024, "Quest: Query-Aware Sparsity
for Efficient Long-Context LLM Inference").

Every block (page) of a full-attention layer keeps the elementwise minimum and maximum of its keys
per KV head, as stored (after rotary; dequantized from a quantized cache), updated whenever keys are
written (``record_key_bounds``). For a query q, no key k of a page scores more than
``sum_c max(q_c * min_c, q_c * max_c)``: each term is the largest q_c * k_c can be with k_c between
the page's minimum and maximum. Split by sign it is two dot products, ``q+ . max + q- . min``
(``page_score_bounds``). A decode row reads the pages of highest bound only, plus its first page
(the attention sink most heads lean on) and its last ``recent_pages`` (the partial last one holds
the token being decoded): the decode kernel runs unchanged on a reduced block table, the chosen
pages in their order and the row's context length cut by the tokens of the pages left out. Keys
carry their rotary already, so no position needs correcting.

The kernels take one block table per row, shared by all its heads, so a row's pages are chosen once,
by the largest bound over its query heads (Quest chooses per head; per-head tables would need a
kernel call per KV head). Every decode row chooses, the rows of a short request (a prefill's last few
tokens) among them, as decoding each of their tokens would; prefill chunks and sliding-window layers
(already bounded by their window) attend densely.

On CPU the bounds' upkeep and the choice are one native call each per layer (octavo/kernels/quest_pages.c),
reading the step's tables and context lengths where the dense decode would: a recorded decode step (kernel
tapes) replays them with the rest. Elsewhere (Triton on CUDA) they are torch ops run eagerly
(``record_key_bounds``, ``PageChoice``) and steps are not recorded: the choice is made per step from Python."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from octavo.attention.base import AttentionBackend, StepLayout
from octavo.attention.kv_quant import LayerKVCache, read_slots
from octavo.attention.kv_spec import KVCacheSpec, LatentKVCacheSpec
from octavo.attention.native_cpu import NativeCpuBackend
from octavo.attention.paged import PagedDecodeBackend, PagedDecodeMetadata
from octavo.kernels.quest_pages import QuestPagesKernel, quest_pages_kernel


def record_key_bounds(cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """Fold the keys just written to ``slot_mapping`` [T] into their blocks' bounds. A block's first
    slot starts it afresh: a block from the pool still holds the bounds of its previous owner, and
    its tokens are always written from slot 0 on (a prefix hit reuses whole blocks, bounds and all)."""
    keys = read_slots(cache, 0, slot_mapping).to(cache.key_bounds.dtype).transpose(0, 1)  # [kv_heads, T, D]
    block = slot_mapping // cache.block_size
    fresh = block[slot_mapping % cache.block_size == 0]
    low, high = cache.key_bounds.unbind(2)  # views: [kv_heads, num_blocks, D] each
    low.index_fill_(1, fresh, float("inf"))
    high.index_fill_(1, fresh, float("-inf"))
    index = block.view(1, -1, 1).expand_as(keys)
    low.scatter_reduce_(1, index, keys, "amin")
    high.scatter_reduce_(1, index, keys, "amax")


def page_score_bounds(q: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """q [rows, heads, D], the key bounds of each row's pages [kv_heads, rows, pages, 2, D] (minimum, maximum;
    query head h reads KV head h // (heads / kv_heads)) -> [rows, pages, heads]: the most q.k can be over a
    page's keys, for each query head."""
    rows, heads, dim = q.shape
    kv_heads, _, pages = bounds.shape[:3]
    group = heads // kv_heads
    grouped = q.reshape(rows, kv_heads, group, dim).permute(1, 0, 3, 2)  # [kv_heads, rows, D, group]
    # One product over both halves: [min, max] . [q-, q+], a matrix product per KV head and row.
    signed = torch.cat((grouped.clamp(max=0), grouped.clamp(min=0)), dim=2).reshape(kv_heads * rows, 2 * dim, group)
    bound = torch.bmm(bounds.reshape(kv_heads * rows, pages, 2 * dim), signed)
    return bound.view(kv_heads, rows, pages, group).permute(1, 2, 0, 3).reshape(rows, pages, heads)


@dataclass
class PageChoice:
    """The torch choice for a step's decode rows ``0 .. rows-1`` (backends without the native kernel)."""

    rows: int
    keep: int  # pages each row reads: its top pages (the first among them) and its recent ones
    # [rows, table width] added to the bounds: +inf for the pages always read (the first, the recent
    # ones), -inf past the row's last page, 0 for the pages the bound decides on.
    bias: torch.Tensor
    # Every decode row's context length once its pages are cut to ``keep``.
    context_lens: torch.Tensor

    def choose(self, q: torch.Tensor, bounds: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The positions in ``table``'s rows [rows, width] of the pages to read, in order: [rows, keep]."""
        rows = table[: self.rows]
        # [kv_heads, rows, width, 2, D]: gathered by block, each head's pages are one matrix already.
        pages = bounds.index_select(1, rows.reshape(-1)).float().view(bounds.shape[0], *rows.shape, 2, -1)
        scores = page_score_bounds(q[: self.rows].float(), pages).amax(dim=-1) + self.bias
        return scores.topk(self.keep, dim=1).indices.sort(dim=1).values

    def narrow(self, q: torch.Tensor, cache: LayerKVCache, dense: PagedDecodeMetadata) -> PagedDecodeMetadata:
        """``dense`` with each decode row's table cut to its chosen pages for this layer's queries."""
        table = dense.decode_block_table.clone()
        chosen = self.choose(q, cache.key_bounds, dense.decode_block_table)
        table[: self.rows, : self.keep] = dense.decode_block_table[: self.rows].gather(1, chosen)
        return dataclasses.replace(dense, decode_block_table=table, decode_context_lens=self.context_lens)


def page_choice(dense: PagedDecodeMetadata, block_size: int, top_pages: int, recent_pages: int) -> PageChoice:
    """The torch choice of the step whose dense decode metadata is ``dense``: every decode row of more than
    ``top_pages + recent_pages`` pages is cut to that many, the others read theirs unchanged."""
    keep = top_pages + recent_pages
    lens = dense.decode_context_lens
    pages = ((lens + block_size - 1) // block_size).unsqueeze(1)
    index = torch.arange(dense.decode_block_table.shape[1], device=lens.device)
    bias = torch.zeros(dense.num_decodes, index.shape[0], device=lens.device)
    bias.masked_fill_((index == 0) | (index >= pages - recent_pages), float("inf"))
    bias.masked_fill_(index >= pages, float("-inf"))
    dropped = (pages.squeeze(1) - keep).clamp(min=0) * block_size
    return PageChoice(dense.num_decodes, keep, bias, lens - dropped.to(lens.dtype))


@dataclass
class NativePageChoice:
    """The native choice (quest_pages.c), made into buffers of the step's decode rows that each layer's
    choice overwrites before its decode reads them."""

    kernel: QuestPagesKernel
    top_pages: int
    recent_pages: int
    table: torch.Tensor  # [rows, top_pages + recent_pages] int64
    context_lens: torch.Tensor  # [rows] int64

    @classmethod
    def empty(cls, kernel: QuestPagesKernel, rows: int, top_pages: int, recent_pages: int,
              device: torch.device) -> NativePageChoice:
        return cls(kernel, top_pages, recent_pages,
                   torch.zeros(rows, top_pages + recent_pages, dtype=torch.int64, device=device),
                   torch.ones(rows, dtype=torch.int64, device=device))

    def narrow(self, q: torch.Tensor, cache: LayerKVCache, dense: PagedDecodeMetadata) -> PagedDecodeMetadata:
        rows = self.table.shape[0]
        self.kernel.select(q[:rows], cache.key_bounds, dense.decode_block_table, dense.decode_context_lens,
                           cache.block_size, self.top_pages, self.recent_pages, self.table, self.context_lens)
        return dataclasses.replace(dense, decode_block_table=self.table, decode_context_lens=self.context_lens)


@dataclass
class QuestMetadata(PagedDecodeMetadata):
    """The inner backend's metadata (dense: what prefill chunks and sliding-window layers read) and the
    step's page choice; None where every decode row attends densely."""

    pages: Optional[PageChoice | NativePageChoice] = None


class QuestBackend(AttentionBackend):
    """A paged decode backend (native, triton) whose full-attention decode rows read chosen pages only."""

    name = "quest"

    def __init__(self, inner: AttentionBackend, top_pages: int, recent_pages: int) -> None:
        if not isinstance(inner, PagedDecodeBackend):
            raise ValueError(f"sparse_attention 'quest' runs the decode kernel over a cut block table: it needs "
                             f"attention_backend native (CPU) or triton (CUDA), got {inner.name!r}")
        super().__init__(inner.windows)
        self.inner = inner
        self.cache_layout = inner.cache_layout
        self.top_pages, self.recent_pages = top_pages, recent_pages
        # The native backend's steps are recorded (kernel tapes) with the native choice in them.
        self.kernel = quest_pages_kernel(required=True) if isinstance(inner, NativeCpuBackend) else None
        self.recorded_on = inner.recorded_on if self.kernel is not None else frozenset()

    def build_metadata(self, layout: StepLayout) -> QuestMetadata:
        dense = self.inner.build_metadata(layout)
        pages = None
        # Decode rows come longest first; a step whose rows all fit in top + recent pages stays dense.
        if dense.num_decodes and -(-dense.max_decode_context // layout.block_size) > self.top_pages + self.recent_pages:
            pages = (page_choice(dense, layout.block_size, self.top_pages, self.recent_pages) if self.kernel is None
                     else NativePageChoice.empty(self.kernel, dense.num_decodes, self.top_pages, self.recent_pages,
                                                 layout.device))
        return _with_pages(dense, pages)

    def static_decode_metadata(self, size: int, max_blocks: int, null_block: int, null_slot: int,
                               max_context: int, device: torch.device) -> QuestMetadata:
        """The inner backend's buffers, and choice buffers every replay fills: a recorded step always chooses
        (a row of few pages reads its table unchanged)."""
        if self.kernel is None:
            raise NotImplementedError("quest steps are recorded with the native page choice only (CPU)")
        dense = self.inner.static_decode_metadata(size, max_blocks, null_block, null_slot, max_context, device)
        return _with_pages(dense, NativePageChoice.empty(self.kernel, size, self.top_pages, self.recent_pages, device))

    def allocate_cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                       static_scales: Optional[torch.Tensor] = None) -> LayerKVCache:
        return self.inner.allocate_cache(spec, num_blocks, device, static_scales)

    def write_kv(self, kv_cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: QuestMetadata) -> None:
        self.inner.write_kv(kv_cache, k, v, meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache,
                meta: QuestMetadata, window: Optional[int], scale: Optional[float] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        dense: PagedDecodeMetadata = meta
        if window is None:
            # This step's keys are in the cache by now (written by the layer or a fused kernel).
            if self.kernel is None:
                record_key_bounds(kv_cache, meta.slot_mapping)
            else:
                self.kernel.fold_bounds(kv_cache.data[0], None if kv_cache.scales is None else kv_cache.scales[0],
                                        kv_cache.key_bounds, meta.slot_mapping)
            if meta.pages is not None:
                dense = meta.pages.narrow(q, kv_cache, meta)
        return self.inner.forward(q, k, v, kv_cache, dense, window, scale, softcap)


def _with_pages(dense: PagedDecodeMetadata, pages: Optional[PageChoice | NativePageChoice]) -> QuestMetadata:
    return QuestMetadata(**{f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}, pages=pages)


def with_key_bounds(specs: Sequence[KVCacheSpec], layer_windows: Iterable[Optional[int]]) -> list[KVCacheSpec]:
    """The specs of a model served with sparse attention: every cache tensor keeps key bounds (layers of
    the full-attention and the window groups share tensors, kv_groups.py). ValueError for a model it
    cannot serve: latent attention keeps no keys to bound, a model of window layers only has nothing
    to choose from."""
    if any(isinstance(spec, LatentKVCacheSpec) for spec in specs):
        raise ValueError("sparse_attention 'quest' bounds keys per page; multi-head latent attention "
                         "(DeepSeek-V2/V3) caches a latent vector instead: leave sparse_attention unset")
    if all(window is not None for window in layer_windows):
        raise ValueError("sparse_attention 'quest' applies to full-attention layers; every layer of this model "
                         "attends within a sliding window already: leave sparse_attention unset")
    return [dataclasses.replace(spec, key_bounds=True) for spec in specs]
