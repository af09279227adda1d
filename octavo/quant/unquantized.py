"""Unquantized weights: torch's F.linear, or bf16 weights prepacked for oneDNN
on CPU with few-row products through Octavo's AMX kernel on those same bytes.

torch's bf16 CPU matmul reorders the weight into oneDNN's blocked layout on
every call. Packing each weight once after loading skips that: 1.3-2.2x
faster products at every batch size on this project's CPUs, the same results
up to the summation order. For up to ``SMALL_ROWS`` rows (decode at small
batch: a pure weight read) the AMX kernel reads the packed weight ~1.1-1.25x
faster than oneDNN does, and an LM head's product up to ``STREAMED_ROWS``
rows it writes past the caches faster (BENCHMARKS.md has the figures).

On CPUs without AMX (the kernels' target, octavo/kernels/cpu_features.py)
bf16 weights stay plain: few-row products go through bf16_linear.c
(AVX-512 BF16 / AVX-512F / AVX2 / portable), more rows through whichever way
a measured table says is fastest for the shape (octavo/quant/linear_table.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels import ops
from octavo.kernels.amx_linear import AmxLinearKernel, AmxWeight, amx_linear_kernel
from octavo.kernels.bf16_linear import bf16_linear_kernel
from octavo.kernels.cpu_features import target_has
from octavo.quant.linear_table import LinearTable, PlannedWeight, make_copies
from octavo.quant.base import FusedMoEMethod, LinearMethod, PreparedWeight, QuantizationScheme, set_weight_attrs
from octavo.quant.moe import ExpertProduct, ExpertsProduct, GroupedProducts, UnquantizedMoEMethod, run_routed

# Batch size oneDNN picks the packed layout for; it serves 1 to 1000+ rows alike.
_PACK_HINT = 128
# Rows up to which the AMX kernel beats oneDNN on the same weights
# (benchmarks/linear_kernels.py, llama-100m's 49 products, 1 thread, CPU
# time: 1.19-1.34x at 1-16 rows, 1.37x at 17-32, 1.03x at 64; 0.90x at 128).
SMALL_ROWS = 64
# Rows up to which a product whose output the AMX kernel writes past the
# caches (an LM head's logits) still goes to it: llama-100m's LM head in a
# batch-256 decode step, 1 thread, CPU time, 8.6-10.4 ms against oneDNN's
# 10.9-12.0 (benchmarks/step_breakdown.py). The layers' products stay with
# oneDNN past SMALL_ROWS: 0.95-1.07x of it at 128-256 rows.
STREAMED_ROWS = 256


@dataclass
class PackedWeight:
    """A layer's weight as its kernels read it, made once after loading; call it like
    ``F.linear(x, weight, bias)`` with bf16 x."""

    onednn: torch.Tensor  # oneDNN's prepacked copy (opaque)
    amx: Optional[AmxWeight]  # the AMX kernel over those same bytes, for few rows

    @classmethod
    def of(cls, weight: torch.Tensor, amx: Optional[AmxLinearKernel]) -> PackedWeight:
        """``weight`` [N, K] bf16 packed for oneDNN, with ``amx`` reading the packed bytes where it can."""
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        return cls(onednn, None if amx is None else amx.share_onednn(onednn, weight))

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        amx = self.amx
        if amx is not None:
            rows = x.numel() // x.shape[-1]
            if rows <= SMALL_ROWS or (rows <= STREAMED_ROWS and amx.streams_output(rows)):
                return ops.call(ops.amx_linear, torch.ops.octavo.amx_linear, x, amx.blocks, bias, amx.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")


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
        packed = PackedWeight.of(weight, self.amx)
        if self.require_amx and packed.amx is None:
            raise ValueError(f"linear_backend 'native': the AMX kernel cannot read the packed weight "
                             f"{tuple(weight.shape)} (in-features not a multiple of 32, or a oneDNN layout "
                             "it does not know)")
        return PreparedWeight(packed, released=("weight",))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        packed: Optional[PackedWeight] = layer.prepared
        if packed is None:
            return F.linear(x, layer.weight, bias)
        return packed(x, bias)

    def experts_method(self) -> FusedMoEMethod:
        """The method for a mixture's experts that multiplies as this one does: prepacked for oneDNN (and
        the AMX kernel) where this one packs, else plain."""
        return PackedMoEMethod(self.amx) if self.pack else UnquantizedMoEMethod()

    def kernel_name(self, layer: nn.Module) -> str:
        packed = layer.prepared
        if packed is None:
            return "torch"
        if packed.amx is None:
            return "onednn"
        streamed = f", <= {STREAMED_ROWS} streamed" if packed.amx.streams_output(STREAMED_ROWS) else ""
        return f"amx (<= {SMALL_ROWS} rows{streamed}) + onednn"


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
        return _table_kernel_name(planned.ways)

    def experts_method(self) -> FusedMoEMethod:
        return TableMoEMethod(self.table)


def _table_kernel_name(ways: dict[int, str]) -> str:
    kernel = bf16_linear_kernel()
    return f"rows {kernel.isa if kernel else '?'} + " + ", ".join(f"<= {b} rows {w}" for b, w in ways.items())


class PreparedExpertsMethod(UnquantizedMoEMethod):
    """Float experts whose prepared weight holds each expert's two products (``gate_up``, ``down``: lists of
    callables ``rows -> rows @ W^T``), made after loading; the plain products until then."""

    def products(self, layer: nn.Module) -> tuple[Callable[[int], ExpertProduct], Callable[[int], ExpertProduct]]:
        prepared = layer.prepared
        if prepared is None:
            return super().products(layer)
        return lambda e: prepared.gate_up[e], lambda e: prepared.down[e]


@dataclass
class PlannedExperts:
    """Every expert's two products as the measured table plans them, on views of the stacked weights."""

    gate_up: list[PlannedWeight]
    down: list[PlannedWeight]


class TableMoEMethod(PreparedExpertsMethod):
    """bf16 experts on a CPU without AMX: kept plain (the few-row kernel reads the stacked weights), and an
    expert given more rows multiplied by the way ``table`` measured fastest for its shape, as a dense
    layer's weight is, rather than by ``F.linear``, which reorders a bf16 weight for oneDNN on every call."""

    def __init__(self, table: LinearTable) -> None:
        self.table = table

    def process_weights_after_loading(self, layer: nn.Module) -> Optional[PreparedWeight]:
        if layer.w13_weight.dtype != torch.bfloat16:
            return None

        def planned(stacked: torch.Tensor) -> list[PlannedWeight]:
            ways = self.table.ways(*stacked.shape[1:])
            return [make_copies(w, ways) for w in stacked.detach()]

        return PreparedWeight(PlannedExperts(planned(layer.w13_weight), planned(layer.w2_weight)))

    def kernel_name(self, layer: nn.Module) -> str:
        planned: Optional[PlannedExperts] = layer.prepared
        if planned is None:
            return super().kernel_name(layer)
        return f"{_table_kernel_name(planned.gate_up[0].ways)} (experts)"


@dataclass
class PackedExperts:
    """Every expert's two products prepacked for oneDNN, and, where the AMX kernel reads every one of
    them, both as one call for all the experts given up to ``SMALL_ROWS`` rows."""

    gate_up: list[PackedWeight]
    down: list[PackedWeight]
    grouped: Optional[GroupedProducts] = field(init=False)

    def __post_init__(self) -> None:
        weights = [w.amx for w in (*self.gate_up, *self.down)]
        if any(w is None for w in weights):
            self.grouped = None
            return
        kernel = amx_linear_kernel(required=True)

        def product(packed: list[PackedWeight]) -> ExpertsProduct:
            blocks = torch.tensor([w.amx.blocks.data_ptr() for w in packed], dtype=torch.int64)
            out_features = packed[0].amx.out_features
            return lambda rows, experts: ops.call(kernel.experts, torch.ops.octavo.amx_linear_experts, rows, blocks,
                                                  experts, out_features)

        self.grouped = GroupedProducts(product(self.gate_up), product(self.down), SMALL_ROWS)


class PackedMoEMethod(PreparedExpertsMethod):
    """bf16 experts on a CPU, each expert's products prepacked for oneDNN once after loading (the stacked
    plain weights released: no second copy), as the dense layers' are: ``F.linear`` on a plain bf16
    weight reorders it on every call, 58 MB per call for one of Mixtral's (halved) experts. Experts given
    up to ``SMALL_ROWS`` rows go through the AMX kernel on the packed bytes, all of them in one call per
    product (the rows of a batch of many requests over few experts); more rows through oneDNN, one call
    per expert. ``amx``: the AMX kernel, or None (oneDNN at every row count)."""

    def __init__(self, amx: Optional[AmxLinearKernel]) -> None:
        self.amx = amx

    def process_weights_after_loading(self, layer: nn.Module) -> Optional[PreparedWeight]:
        if layer.w13_weight.dtype != torch.bfloat16:
            return None
        packed = PackedExperts([PackedWeight.of(w, self.amx) for w in layer.w13_weight.detach()],
                               [PackedWeight.of(w, self.amx) for w in layer.w2_weight.detach()])
        return PreparedWeight(packed, released=("w13_weight", "w2_weight"))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        packed: Optional[PackedExperts] = layer.prepared
        if packed is None:
            return super().apply(layer, x, topk_weights, topk_ids)
        return run_routed(layer, x, topk_weights, topk_ids, *self.products(layer), packed.grouped)

    def kernel_name(self, layer: nn.Module) -> str:
        packed: Optional[PackedExperts] = layer.prepared
        if packed is None:
            return super().kernel_name(layer)
        return "onednn (experts)" if packed.grouped is None else f"amx (<= {SMALL_ROWS} rows) + onednn (experts)"

    def weight_bytes(self, layer: nn.Module) -> int:
        packed: Optional[PackedExperts] = layer.prepared
        if packed is None:
            return super().weight_bytes(layer)
        return sum(torch.ops.mkldnn._nbytes(w.onednn) for w in (*packed.gate_up, *packed.down))


class UniformScheme(QuantizationScheme):
    """One method for every layer: unquantized models (the default scheme)."""

    def __init__(self, method: Optional[LinearMethod] = None) -> None:
        self.method = method or UnquantizedLinearMethod()

    def linear_method(self, prefix: str) -> LinearMethod:
        return self.method

    def moe_method(self, prefix: str, names: tuple[str, str, str], num_experts: int) -> FusedMoEMethod:
        if isinstance(self.method, UnquantizedLinearMethod):
            return self.method.experts_method()
        return UnquantizedMoEMethod()

    def describe(self) -> str:
        return f"{type(self.method).__name__} for every layer"
