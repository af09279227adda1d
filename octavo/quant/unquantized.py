"""Unquantized weights: torch's F.linear, or bf16 weights prepacked for oneDNN
on CPU with few-row products through Octavo's AMX kernel on those same bytes.

torch's bf16 CPU matmul reorders the weight into oneDNN's blocked layout on
every call. Packing each weight once after loading skips that: 1.3-2.2x
faster products at every batch size on this project's CPUs, the same results
up to the summation order. For up to ``SMALL_ROWS`` rows (decode at small
batch: a pure weight read) the AMX kernel reads the packed weight ~1.1-1.25x
faster than oneDNN does (BENCHMARKS.md has the figures).

On CPUs without AMX (the kernels' target, octavo/kernels/cpu_features.py)
bf16 weights stay plain: few-row products go through bf16_linear.c
(AVX-512 BF16 / AVX-512F / AVX2 / portable), more rows through whichever way
a measured table says is fastest for the shape (octavo/quant/linear_table.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels import ops
from octavo.kernels.amx_linear import AmxLinearKernel, AmxWeight, amx_linear_kernel
from octavo.kernels.bf16_linear import bf16_linear_kernel
from octavo.kernels.cpu_features import target_has
from octavo.quant.linear_table import LinearTable, PlannedWeight, make_copies
from octavo.quant.base import FusedMoEMethod, LinearMethod, PreparedWeight, QuantizationScheme, set_weight_attrs
from octavo.quant.moe import UnquantizedMoEMethod

# Batch size oneDNN picks the packed layout for; it serves 1 to 1000+ rows alike.
_PACK_HINT = 128
# Rows up to which the AMX kernel beats oneDNN on the same weights
# (benchmarks/linear_kernels.py, llama-100m's 49 products, 1 thread, CPU
# time: 1.19-1.34x at 1-16 rows, 1.37x at 17-32, 1.03x at 64; 0.90x at 128).
SMALL_ROWS = 64


@dataclass
class PackedWeight:
    """A layer's weight as its kernels read it, made once after loading."""

    onednn: torch.Tensor  # oneDNN's prepacked copy (opaque)
    amx: Optional[AmxWeight]  # the AMX kernel over those same bytes, for few rows


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class UnquantizedLinearMethod(LinearMethod):
    """``pack``: prepack bf16 weights for oneDNN after loading; ``amx``: the
    kernel for few-row products (only with ``pack``). Neither: F.linear.
    ``require_amx``: a weight the AMX kernel cannot read is an error
    (``linear_backend native``), not a silent fall back to oneDNN."""

    def __init__(self, pack: bool = False, amx: Optional[AmxLinearKernel] = None, require_amx: bool = False) -> None:
        if amx is not None and not pack:
            raise ValueError("the AMX kernel reads oneDNN's packed weights: amx needs pack")
        self.pack, self.amx, self.require_amx = pack, amx, require_amx

    @classmethod
    def for_backend(cls, backend: str, device: torch.device, dtype: torch.dtype,
                    weight_copies: bool = False) -> UnquantizedLinearMethod:
        """The method ``ModelConfig.linear_backend`` (validated there) names,
        for weights of ``dtype`` on ``device``; ValueError when that backend
        cannot run there. ``weight_copies``: the measured table may choose
        ways that keep a second copy of a weight (CPUs without AMX)."""
        if backend == "torch":
            return cls()
        if (backend in ("auto", "native") and device.type == "cpu" and dtype == torch.bfloat16
                and not target_has("amx_tile")
                and bf16_linear_kernel(required=backend == "native") is not None):
            return TableLinearMethod(LinearTable(copies=weight_copies))
        if not can_pack(device, dtype):
            if backend != "auto":
                raise ValueError(f"linear_backend {backend!r} runs bfloat16 weights on a CPU with oneDNN bf16 "
                                 f"support; got dtype {dtype} on {device.type}")
            return cls()
        amx = amx_linear_kernel(required=backend == "native") if backend in ("auto", "native") else None
        return cls(pack=True, amx=amx, require_amx=backend == "native")

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> Optional[PreparedWeight]:
        """Pack a bf16 weight, then release the plain copy. A tied embedding keeps its own reference to it."""
        if not self.pack or layer.weight.dtype != torch.bfloat16:
            return None
        weight = layer.weight.detach()
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        amx = None if self.amx is None else self.amx.share_onednn(onednn, weight)
        if self.require_amx and amx is None:
            raise ValueError(f"linear_backend 'native': the AMX kernel cannot read the packed weight "
                             f"{tuple(weight.shape)} (in-features not a multiple of 32, or a oneDNN layout "
                             "it does not know)")
        return PreparedWeight(PackedWeight(onednn, amx), released=("weight",))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        packed: Optional[PackedWeight] = layer.prepared
        if packed is None:
            return F.linear(x, layer.weight, bias)
        if packed.amx is not None and x.numel() <= SMALL_ROWS * x.shape[-1]:
            amx = packed.amx
            return ops.call(ops.amx_linear, torch.ops.octavo.amx_linear, x, amx.blocks, bias, amx.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")

    def kernel_name(self, layer: nn.Module) -> str:
        packed = layer.prepared
        if packed is None:
            return "torch"
        return "onednn" if packed.amx is None else f"amx (<= {SMALL_ROWS} rows) + onednn"


class TableLinearMethod(UnquantizedLinearMethod):
    """bf16 weights on a CPU without AMX: kept plain, multiplied by the way
    ``table`` measured fastest for their shape and the number of rows."""

    def __init__(self, table: LinearTable) -> None:
        super().__init__()
        self.table = table

    def process_weights_after_loading(self, layer: nn.Module) -> Optional[PreparedWeight]:
        if layer.weight.dtype != torch.bfloat16:
            return None
        weight = layer.weight.detach().contiguous()
        return PreparedWeight(make_copies(weight, self.table.ways(*weight.shape)))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        planned: Optional[PlannedWeight] = layer.prepared
        if planned is None:
            return F.linear(x, layer.weight, bias)
        return planned(x, bias)

    def kernel_name(self, layer: nn.Module) -> str:
        planned = layer.prepared
        if planned is None:
            return "torch"
        kernel = bf16_linear_kernel()
        return f"rows {kernel.isa if kernel else '?'} + " + ", ".join(
            f"<= {b} rows {w}" for b, w in planned.ways.items())


class UniformScheme(QuantizationScheme):
    """One method for every layer: unquantized models (the default scheme)."""

    def __init__(self, method: Optional[LinearMethod] = None) -> None:
        self.method = method or UnquantizedLinearMethod()

    def linear_method(self, prefix: str) -> LinearMethod:
        return self.method

    def moe_method(self, prefix: str, names: tuple[str, str, str], num_experts: int) -> FusedMoEMethod:
        return UnquantizedMoEMethod()

    def describe(self) -> str:
        return f"{type(self.method).__name__} for every layer"
