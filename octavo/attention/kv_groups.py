"""KV cache groups: which layers share a block table, and which share a cache tensor.

Layers that keep the same positions (every position, or the same sliding window) form a group; the
scheduler keeps one block table per group per request (octavo/core/kv_cache_manager.py), so a window
group's blocks go back to the pool once no query can see them. Every group draws its blocks from one
pool, so a block id must stand for the same bytes in every group and leave nothing unused: the groups
are made the same size (the layer count of the rarest kind; a kind with more layers splits into
several groups) and layer j of every group shares cache tensor j, its "slot". Block b of slot j then
holds the K/V of layer j of whichever group holds block b.

Gemma 2 (every other layer slides): a full group and a window group of n/2 layers each, n/2 tensors,
a block id costing n/2 layers' bytes; the same memory as one table over n layers, but the window
group holds only its window. A model with one kind of layer (Llama, Mistral) is one group of all its
layers, a tensor each: as without groups. When the kinds' counts do not divide (Qwen2 with
max_window_layers), the last group of a kind is smaller and its block ids leave the slots past its
size unused: the only memory groups waste."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class KVCacheGroups:
    """``windows[g]``: group g's sliding window (None: it keeps every position); ``layers[g]``: its
    layers (the model's indices, all pipeline stages), in order; layer ``layers[g][j]`` uses slot j."""

    windows: tuple[Optional[int], ...]
    layers: tuple[tuple[int, ...], ...]

    def group_of(self, layer: int) -> int:
        return next(g for g, members in enumerate(self.layers) if layer in members)

    def slot_of(self, layer: int) -> int:
        return self.layers[self.group_of(layer)].index(layer)


def group_layers(layer_windows: Sequence[Optional[int]]) -> KVCacheGroups:
    """The groups of a model whose layer i attends within ``layer_windows[i]`` (None: everything).
    Every rank computes them from the whole model, so pipeline stages agree on the groups."""
    kinds: dict[Optional[int], list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(members) for members in kinds.values())
    windows, layers = [], []
    for window, members in kinds.items():
        for start in range(0, len(members), size):
            windows.append(window)
            layers.append(tuple(members[start : start + size]))
    return KVCacheGroups(tuple(windows), tuple(layers))
