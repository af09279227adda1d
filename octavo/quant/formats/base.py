"""What a pre-quantized format says about one linear layer: the tensors the
checkpoint holds for it (names, this rank's shapes, how each is split across
ranks and fused parts) and how to turn them into an ``IntWeight``.

Shapes are this rank's: a column-parallel layer has its share of the output
features, a row-parallel one its share of the input features. A dim a
format packs 32 // bits values into (``packed_dim``) is counted in int32
words, so a fused part's offset along it is its feature offset / ``pack_factor``
(the layers' ``output_part`` does that).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from octavo.quant.formats.int_weight import IntWeight
from octavo.quant.formats.packing import pack_factor


@dataclass(frozen=True)
class LayerShape:
    """One linear layer on this rank: ``in_features`` of ``input_shards``
    equal slices of the checkpoint's input features (row-parallel: the
    tensor-parallel size; else 1), and the fused parts' output features."""

    in_features: int
    out_sizes: tuple[int, ...]
    input_shards: int = 1

    @property
    def out_features(self) -> int:
        return sum(self.out_sizes)

    @property
    def full_in_features(self) -> int:
        return self.in_features * self.input_shards


@dataclass(frozen=True)
class TensorSpec:
    """A checkpoint tensor of the layer (``<module>.<name>``).

    ``output_dim`` / ``input_dim``: the dims split across ranks and fused
    parts (None: whole on every rank, each fused part's copy loaded over
    the last). ``packed_dim``: the dim counted in int32 words of
    ``pack_factor`` values. ``per_part``: a leading dim with each fused
    part's own copy (see ``group_index_spec``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    output_dim: Optional[int]
    input_dim: Optional[int]
    packed_dim: Optional[int] = None
    pack_factor: int = 1
    per_part: bool = False


class PackedFormat(ABC):
    """One checkpoint format at one bit width and group size."""

    #: the format's name in errors and the start-up log
    name: str
    #: the layers round their inputs to int8 per token (W8A8), not only their weights
    int8_activations: bool = False

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.pack = pack_factor(bits)

    @abstractmethod
    def tensors(self, shape: LayerShape) -> list[TensorSpec]:
        """The layer's checkpoint tensors; ValueError when the layer's shape
        cannot be stored this way on this rank (naming the size that does not divide)."""

    @abstractmethod
    def unpack(self, tensors: dict[str, torch.Tensor], shape: LayerShape) -> IntWeight:
        """The loaded tensors (by ``TensorSpec.name``) as one IntWeight of
        this rank's [out_features, in_features]."""

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.name} int{self.bits} {group}{', int8 activations' if self.int8_activations else ''}"

    # Helpers the formats share -------------------------------------------------
    def groups_here(self, shape: LayerShape) -> int:
        """Groups along this rank's input features (1 for per-channel); ValueError
        when a group would straddle two ranks."""
        if self.group_size == -1:
            return 1
        if shape.in_features % self.group_size:
            raise ValueError(
                f"group_size {self.group_size} does not divide the {shape.in_features} input features of a "
                f"layer on this rank ({shape.full_in_features} / {shape.input_shards} ranks): "
                "a quantization group would be split between ranks"
            )
        return shape.in_features // self.group_size

    def groups_all(self, shape: LayerShape) -> int:
        """Groups along the checkpoint's whole input dim (act-order tensors are whole on every rank)."""
        if self.group_size == -1:
            return 1
        return -(-shape.full_in_features // self.group_size)

    def check_packs(self, sizes: tuple[int, ...], what: str) -> None:
        for size in sizes:
            if size % self.pack:
                raise ValueError(f"{self.describe()} packs {self.pack} values per int32 along the {what}, "
                                 f"but a layer has {size} there on this rank")

    def effective_group(self, shape: LayerShape) -> int:
        """Columns per group on this rank (per-channel: all of them)."""
        return shape.in_features if self.group_size == -1 else self.group_size

    def group_index_spec(self, name: str, shape: LayerShape) -> TensorSpec:
        """An act-order ``g_idx`` [K], split with the input features. A fused
        layer keeps each part's ([parts, K]): the parts share their input, so
        the tools give them one order, and ``group_index`` checks that."""
        k, parts = shape.in_features, len(shape.out_sizes)
        if parts == 1:
            return TensorSpec(name, (k,), torch.int32, output_dim=None, input_dim=0)
        return TensorSpec(name, (parts, k), torch.int32, output_dim=None, input_dim=None, per_part=True)


def group_index(g_idx: torch.Tensor) -> torch.Tensor:
    """The layer's one g_idx from ``group_index_spec``'s tensor; ValueError
    when fused parts disagree (one input order cannot serve both)."""
    if g_idx.dim() == 1:
        return g_idx
    if bool((g_idx != g_idx[0]).any()):
        raise ValueError("the fused parts (q/k/v or gate/up) have different g_idx: act-order permutations "
                         "must agree for the parts to run as one layer")
    return g_idx[0]
