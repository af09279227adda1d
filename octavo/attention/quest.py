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
kernel call per KV head). Prefill chunks, the rows of short requests (a prefill's last few tokens)
and sliding-window layers (already bounded by their window) attend densely. Recorded decode steps
are off: the choice changes the tables inside every layer of every step."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from octavo.attention.kv_quant import LayerKVCache, read_slots
from octavo.attention.kv_spec import KVCacheSpec, LatentKVCacheSpec
from octavo.attention.paged import PagedDecodeBackend, PagedDecodeMetadata


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
    """What a step's decode rows ``0 .. rows-1`` need to choose their pages in each layer."""

    rows: int
    keep: int  # pages each row reads: its top pages (the first among them) and its recent ones
    # [rows, table width] added to the bounds: +inf for the pages always read (the first, the recent
    # ones), -inf past the row's last page, 0 for the pages the bound decides on.
    bias: torch.Tensor
    # Every decode row's context length once its pages are cut to ``keep`` (the others unchanged).
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


def page_choice(layout: StepLayout, dense: PagedDecodeMetadata, top_pages: int, recent_pages: int
                ) -> Optional[PageChoice]:
    """The step's choice, or None when no decode row has more than ``top_pages + recent_pages`` pages
    (every one then attends densely, exactly as without sparse attention)."""
    keep = top_pages + recent_pages
    rows = layout.num_decodes
    if not rows or layout.blocks_needed[0] <= keep:  # decodes come longest first
        return None
    table = dense.decode_block_table
    device = table.device
    pages = torch.tensor(layout.blocks_needed[:rows], device=device).unsqueeze(1)
    index = torch.arange(table.shape[1], device=device)
    bias = torch.zeros(rows, table.shape[1], device=device)
    bias.masked_fill_((index == 0) | (index >= pages - recent_pages), float("inf"))
    bias.masked_fill_(index >= pages, float("-inf"))
    lens = dense.decode_context_lens.clone()
    dropped = (pages.squeeze(1) - keep).clamp(min=0) * layout.block_size
    lens[:rows] -= dropped.to(lens.dtype)
    return PageChoice(rows, keep, bias, lens)


@dataclass
class QuestMetadata(AttentionMetadata):
    dense: PagedDecodeMetadata  # the inner backend's, for prefill chunks and sliding-window layers
    pages: Optional[PageChoice]  # None: every decode row attends densely this step


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

    def build_metadata(self, layout: StepLayout) -> QuestMetadata:
        dense = self.inner.build_metadata(layout)
        pages = page_choice(layout, dense, self.top_pages, self.recent_pages)
        return QuestMetadata(dense.slot_mapping, dense.num_decodes, dense.prefills, dense, pages)

    def allocate_cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                       static_scales: Optional[torch.Tensor] = None) -> LayerKVCache:
        return self.inner.allocate_cache(spec, num_blocks, device, static_scales)

    def write_kv(self, kv_cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, meta: QuestMetadata) -> None:
        self.inner.write_kv(kv_cache, k, v, meta.dense)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache,
                meta: QuestMetadata, window: Optional[int], scale: Optional[float] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        dense = meta.dense
        if window is None:
            # This step's keys are in the cache by now (written by the layer or a fused kernel).
            record_key_bounds(kv_cache, meta.slot_mapping)
            if meta.pages is not None:
                dense = meta.pages.narrow(q, kv_cache, dense)
        return self.inner.forward(q, k, v, kv_cache, dense, window, scale, softcap)


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
