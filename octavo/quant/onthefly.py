"""Quantize a bf16/float32 checkpoint's linear weights while loading it
(``--quantization int8|int4|w8a8``).

int8: per-output-channel symmetric, scale = max|w| / 127 (W8A16).
w8a8: the same int8 weights, multiplied by activations rounded to int8 per
token on every call (octavo/quant/w8a8.py).
Under tensor parallelism the ranks of a row-parallel layer share each
row's max, so a split model holds the unsplit one's integers.
int4: groups of ``group_size`` consecutive inputs, asymmetric:
scale = (max - min) / 15 and a float zero point -min / scale, so each
group's range maps onto 0..15 exactly (a float zero point rather than an
integer one: the extremes are not clipped).

Each layer loads its weight as the unquantized method would, then
``process_weights_after_loading`` quantizes it in row chunks and drops the
float copy: the model never holds more than its float weights plus one
layer's integers. Layers whose module path matches one of ``keep`` (fnmatch
patterns) stay unquantized. The lm_head has a format of its own (int8 under
int4 and int8 by default, config.py says why). The embedding table is never quantized
(a gather, not a product), not even when the lm_head is tied to it: the head
then quantizes its own copy.
"""
from __future__ import annotations

from fnmatch import fnmatch
from typing import Optional, Union

import torch
from torch import nn

from octavo.config import LM_HEAD
from octavo.distributed.communication import tensor_model_parallel_all_gather
from octavo.quant.base import FusedMoEMethod, LinearMethod, PreparedWeight, QuantizationScheme
from octavo.quant.qweights import Int4Weight, Int8Weight, QuantizedWeight
from octavo.quant.moe import QuantizedMoEMethod, UnquantizedMoEMethod
from octavo.quant.quantized import QuantizedLinearMethod
from octavo.quant.unquantized import UnquantizedLinearMethod
from octavo.quant.w8a8 import W8A8Weight

BITS = {"int8": 8, "int4": 4, "w8a8": 8}
GROUP_SIZES = (32, 64, 128)
# Rows quantized at a time: bounds the float32 temporaries for a big layer.
_CHUNK_ROWS = 4096


def int8_channels(weight: torch.Tensor, row_max: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale float32 [N]): per-output-channel symmetric int8
    of ``weight`` [N, K]; ``row_max``: each whole row's max |w| when
    ``weight`` holds a slice of the rows."""
    if row_max is None:
        row_max = weight.abs().amax(dim=1).float()
    scale = row_max / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    qs = [torch.round(rows.float() / s[:, None]).clamp_(-127, 127).to(torch.int8)
          for rows, s in zip(weight.split(_CHUNK_ROWS), scale.split(_CHUNK_ROWS))]
    return torch.cat(qs), scale


def quantize_int8(weight: torch.Tensor, row_max: Optional[torch.Tensor] = None) -> Int8Weight:
    """``int8_channels`` as a W8A16 weight."""
    return Int8Weight(*int8_channels(weight, row_max))


def quantize_w8a8(weight: torch.Tensor, row_max: Optional[torch.Tensor] = None) -> W8A8Weight:
    """``int8_channels`` as a W8A8 weight (its inputs rounded to int8 per row)."""
    return W8A8Weight(*int8_channels(weight, row_max))


def _whole_row_max(layer: nn.Module, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """Max |w| of the whole rows of a row-parallel layer's weight (its ranks
    hold slices of them), so every rank quantizes with tp_size 1's scales;
    None for a layer that holds whole rows."""
    if not getattr(layer, "splits_input", False) or layer.tp_size == 1:
        return None
    local = weight.abs().amax(dim=1).float().unsqueeze(0)
    return tensor_model_parallel_all_gather(local, dim=0).amax(dim=0)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Group-wise asymmetric int4 of ``weight`` [N, K], K a multiple of ``group_size``."""
    n, k = weight.shape
    qs, scales, zeros = [], [], []
    for rows in weight.split(_CHUNK_ROWS):
        w = rows.float().view(rows.shape[0], k // group_size, group_size)
        lo, hi = w.amin(dim=2), w.amax(dim=2)
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = -lo / scale
        q = torch.round(w / scale[..., None] + zero[..., None]).clamp_(0, 15).to(torch.uint8)
        qs.append(q.view(rows.shape[0], k))
        scales.append(scale)
        zeros.append(zero)
    return Int4Weight(torch.cat(qs), torch.cat(scales), torch.cat(zeros), group_size)


class OnTheFlyLinearMethod(QuantizedLinearMethod):
    """Loads the float weight like the unquantized method, then quantizes it;
    ``activations``: int8 activations too (W8A8; bits 8)."""

    def __init__(self, bits: int, group_size: int, activations: bool = False) -> None:
        if bits not in (4, 8) or (activations and bits != 8):
            raise ValueError(f"bits must be 4 or 8 (8 with int8 activations); got {bits}")
        self.bits, self.group_size, self.activations = bits, group_size, activations

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        self.check_in_features(input_size, getattr(layer, "prefix", "") or "a linear layer")
        UnquantizedLinearMethod().create_weights(layer, input_size, output_sizes, dtype)

    def check_in_features(self, input_size: int, where: str) -> None:
        """int4 cuts every row of in-features into whole groups: a ValueError naming the option where
        ``group_size`` does not divide ``input_size`` (of ``where``)."""
        if self.bits == 4 and input_size % self.group_size:
            raise ValueError(f"quantization_group_size {self.group_size} does not divide the in-features "
                             f"{input_size} of {where}")

    def process_weights_after_loading(self, layer: nn.Module) -> PreparedWeight:
        weight = layer.weight.detach()
        return self.prepared(self.quantize(weight, _whole_row_max(layer, weight)), ("weight",))

    def quantize(self, weight: torch.Tensor, row_max: Optional[torch.Tensor] = None
                 ) -> Union[QuantizedWeight, W8A8Weight]:
        """``weight`` [out, in] for the kernels; ``row_max``: whole rows' max |w| where this rank holds slices."""
        if self.activations:
            return quantize_w8a8(weight, row_max)
        if self.bits == 8:
            return quantize_int8(weight, row_max)
        return quantize_int4(weight, self.group_size)


class OnTheFlyScheme(QuantizationScheme):
    """``quantization`` (int8/int4/w8a8) for every linear layer but those
    matching ``keep``, which get ``unquantized``, and the lm_head, which gets
    ``head`` (int8 or int4; None: ``unquantized``)."""

    def __init__(self, quantization: str, group_size: int, keep: tuple[str, ...],
                 unquantized: Optional[LinearMethod] = None, head: Optional[str] = None) -> None:
        if quantization not in BITS:
            raise ValueError(f"quantization must be one of {', '.join(BITS)}; got {quantization!r}")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {GROUP_SIZES}; got {group_size!r}")
        if head not in (None, "int8", "int4"):
            raise ValueError(f"lm_head_quantization must be int8, int4 or none; got {head!r}")
        self.name, self.keep, self.head_name = quantization, keep, head
        self.quantized = OnTheFlyLinearMethod(BITS[quantization], group_size, activations=quantization == "w8a8")
        self.unquantized = unquantized or UnquantizedLinearMethod()
        self.head = self.unquantized if head is None else OnTheFlyLinearMethod(BITS[head], group_size)

    def linear_method(self, prefix: str) -> LinearMethod:
        if prefix == LM_HEAD:
            return self.head
        if any(fnmatch(prefix, pattern) for pattern in self.keep):
            return self.unquantized
        return self.quantized

    def moe_method(self, prefix: str, names: tuple[str, str, str], num_experts: int) -> FusedMoEMethod:
        """Experts quantized as the linear layers are (int4 groups along each expert's in-features;
        int8 rows over this rank's slice of them)."""
        if any(fnmatch(prefix, pattern) for pattern in self.keep):
            return UnquantizedMoEMethod()
        return QuantizedMoEMethod(self.quantized.quantize, self.quantized.check_in_features, prefix)

    def describe(self) -> str:
        group = f", groups of {self.quantized.group_size}" if self.quantized.bits == 4 else ""
        if self.quantized.activations:
            group = ", activations rounded to int8 per token"
        kept = ", ".join(self.keep) or "none"
        return f"{self.name} on the fly{group}; {LM_HEAD}: {self.head_name or 'unquantized'}; kept unquantized: {kept}"
