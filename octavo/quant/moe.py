"""The mixture-of-experts methods (the seam, ``FusedMoEMethod``, is in quant/base.py beside
``LinearMethod``): float experts, and experts quantized on the fly to int8 / int4 / w8a8 on the
linear kernels (a pre-quantized checkpoint's experts: quant/prequantized.py).

Both run the same way: the (token, choice) pairs are sorted by expert, so each expert's rows are
one contiguous slice; one gate/up product, the activation and one down product per expert that has
rows, then the weighted results summed per token. Experts no token chose cost nothing and their
weights are never read (at batch 1 only ``top_k`` experts' bytes are). The experts given few rows
(decode) go through one call per product for all of them (``GroupedProducts``: quantized experts
with int8 rows on qdot_linear.c, bf16 ones on bf16_linear.c) rather than one per expert: on
Qwen3-30B-A3B's layer at one token that is 1.8x less CPU time in bf16 (``F.linear`` reorders a bf16
weight for oneDNN on every call) and 1.3x in int4 (benchmarks/moe.py --layer, BENCHMARKS.md). The
experts given more rows (a batch of many requests over few experts: Mixtral's 8 take ~8 rows each at
32 requests) go through a second grouped call where there is one (``many``: quantized experts with
bf16 rows on AMX tiles, from the rows per expert a measured table says the first call stops winning),
and bf16 experts prepacked for oneDNN take the AMX kernel up to 64 rows
(quant/unquantized.py's ``PackedMoEMethod``)."""
from __future__ import annotations

import sys
from abc import ABC
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels import ops
from octavo.kernels.bf16_linear import bf16_linear_kernel
from octavo.kernels.qdot_linear import QdotLinearKernel
from octavo.quant.base import FusedMoEMethod, PreparedWeight, set_weight_attrs
from octavo.quant.linear_table import shared_table
from octavo.quant.prequantized_weight import KernelWeight
from octavo.quant.qweights import FMA_ROWS, QDOT_ROWS, QuantizedWeight

# One expert's product: rows [n, in] -> [n, out].
ExpertProduct = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GroupedProduct:
    """One product (gate/up or down) of every expert, multiplied for rows of several experts in one call
    (qdot_linear.c's experts kernel, or with ``amx`` quant_linear.c's on AMX tiles), the experts' weights
    reached through tables of their addresses."""

    weights: list[QuantizedWeight]  # held here: the tables point into their tensors
    packed: torch.Tensor  # int64 [experts]: the address of each expert's packed weight
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    amx: bool = False

    @classmethod
    def of(cls, weights: Sequence[QuantizedExpert], amx: bool = False) -> Optional[GroupedProduct]:
        """None where the kernel cannot take every expert of ``weights``: one not on its path (the integer
        dot products: float rows asked for, a shape it does not take; AMX: a CPU without it, a shape it does
        not take), act-order, dequantized or W8A8 weights, or experts of different shapes, bits or group
        sizes."""
        if not weights or not all(isinstance(w, QuantizedWeight) and (w.amx if amx else w.qdot is not None)
                                  and w.perm is None for w in weights):
            return None
        first = weights[0]
        shape = (first.bits, first.group_size, first.out_features, first.in_features, first.mins is None)
        if any((w.bits, w.group_size, w.out_features, w.in_features, w.mins is None) != shape for w in weights):
            return None

        def table(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
            return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)

        mins = None if first.mins is None else table([w.mins for w in weights])
        return cls(list(weights), table([w.packed for w in weights]), table([w.scales for w in weights]), mins, amx)

    def __call__(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Row m [M, in] times expert ``experts[m]`` (rows of one expert together) -> [M, out]."""
        first = self.weights[0]
        if self.amx:
            return ops.call(ops.quant_linear_experts, torch.ops.octavo.quant_linear_experts, rows.contiguous(),
                            experts, first.bits, first.group_size, self.packed, self.scales, self.mins,
                            first.out_features)
        return ops.call(first.qdot.experts, torch.ops.octavo.qdot_linear_experts, rows.contiguous(), experts,
                        first.bits, first.group_size, self.packed, self.scales, self.mins, first.out_features)


# Rows of several experts, each times its own expert's weight: rows [M, in], experts [M] (rows of one
# expert next to each other) -> [M, out].
ExpertsProduct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GroupedProducts:
    """Both products of every expert, each one call for the rows of all the experts given ``min_rows`` to
    ``max_rows`` rows (the kernels' few-row paths; the many-row ones from ``min_rows``)."""

    gate_up: ExpertsProduct
    down: ExpertsProduct
    max_rows: int
    min_rows: int = 1

    def run(self, layer: nn.Module, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each row through its expert's gated MLP: rows sorted by expert, ``experts`` their experts."""
        gate, up = self.gate_up(rows, experts).chunk(2, dim=-1)
        return self.down(layer.activation(gate) * up, experts)


def run_routed(layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               gate_up: Callable[[int], ExpertProduct], down: Callable[[int], ExpertProduct],
               grouped: Optional[GroupedProducts] = None, many: Optional[GroupedProducts] = None) -> torch.Tensor:
    """sum over k of ``topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])``, each expert's products
    given by ``gate_up(e)`` and ``down(e)`` (``e`` counted from the layer's ``expert_start``), or, for
    the experts given at most ``grouped.max_rows`` rows, by ``grouped``'s one call per product for all
    of them, and for the others given ``many.min_rows`` to ``many.max_rows`` rows by ``many``'s. The
    pairs routed to experts the layer does not hold (another rank's, under expert parallelism) are left
    out: their tokens get nothing from here."""
    top_k = topk_ids.shape[1]
    local = topk_ids.flatten() - layer.expert_start
    if grouped is not None and layer.num_experts == layer.total_experts and topk_ids.shape[0] <= grouped.max_rows:
        # Decode: no expert has more rows than there are tokens, so all of them go through the grouped
        # calls, with nothing read back to Python (no counts per expert).
        order = local.argsort(stable=True)
        rows_of = order // top_k
        out = grouped.run(layer, x.index_select(0, rows_of), local.index_select(0, order))
        return _weighted_sum(out, topk_weights, order)
    pairs = None  # which (token, choice) pairs run here: all of them
    if layer.num_experts < layer.total_experts:
        pairs = ((local >= 0) & (local < layer.num_experts)).nonzero().flatten()
        local = local.index_select(0, pairs)
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=layer.num_experts)
    experts = local.index_select(0, order)  # the expert of each sorted (token, choice) pair
    if pairs is not None:
        order = pairs.index_select(0, order)  # back to indices of the (token, choice) pairs
    rows_of = order // top_k  # the token of each sorted (token, choice) pair
    routed = x.index_select(0, rows_of)
    out = torch.empty_like(routed)
    looped = counts > 0  # the experts multiplied one call each
    for products in (p for p in (grouped, many) if p is not None):
        taken = looped & (counts >= products.min_rows) & (counts <= products.max_rows)
        looped &= ~taken
        rows = taken.index_select(0, experts).nonzero().flatten()
        chosen = experts.index_select(0, rows)
        out.index_copy_(0, rows, products.run(layer, routed.index_select(0, rows), chosen))
    starts = counts.cumsum(0) - counts
    for expert, start, count in zip(looped.nonzero().flatten().tolist(), starts[looped].tolist(),
                                    counts[looped].tolist()):
        rows = slice(start, start + count)
        gate, up = gate_up(expert)(routed[rows]).chunk(2, dim=-1)
        out[rows] = down(expert)(layer.activation(gate) * up)
    return _weighted_sum(out, topk_weights, order)


def _weighted_sum(out: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Each sorted pair's result ``out`` (``order``: its (token, choice) index) times its routing weight, summed
    into its token's row. The pairs are put back in (token, choice) order and summed over the choices, rather
    than added into the tokens' rows one by one: ``index_add_`` on a bf16 CPU tensor adds a row at a time, which
    took 2 of the 9 s of Mixtral's offline run at 32 requests (2048 prompt tokens, loaded)."""
    out.mul_(topk_weights.flatten().index_select(0, order).unsqueeze(1).to(out.dtype))
    tokens, top_k = topk_weights.shape
    # Pairs this rank does not run (another's experts) stay zero.
    pairs = out.new_zeros(tokens * top_k, out.shape[1]) if out.shape[0] < tokens * top_k else torch.empty_like(out)
    return pairs.index_copy_(0, order, out).view(tokens, top_k, -1).sum(dim=1)


# Rows of one expert up to which bf16 experts take the few-row kernel's one call for all of them: it reads
# each chosen expert's weights once for all its rows, and on Qwen3-30B-A3B's experts (8 of them, avx512_bf16 on
# a Zen 4 EPYC, one thread, CPU time, loaded) took 0.86 / 0.89 / 0.92x the time of the best per-expert way at
# 4 / 8 / 16 rows each (bf16_linear.c, one call per expert), 1.06x at 32 (bf16_gemm.c's dot products, one call
# per expert). Up to this many tokens a decode step so runs every expert in one call per product, nothing read
# back, and records as a kernel tape: an offline batch of 32 requests included (~2 rows per expert).
BF16_EXPERT_ROWS = 32


class UnquantizedMoEMethod(FusedMoEMethod):
    """Float experts, multiplied by ``F.linear`` on each expert's slice of the weights; bf16 ones on a CPU
    at few rows per expert by the few-row kernel (bf16_linear.c), every expert in one call per product
    (``F.linear`` on a bf16 weight reorders it for oneDNN on every call)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        for name, shape in (("w13_weight", (num_experts, 2 * intermediate, hidden)),
                            ("w2_weight", (num_experts, hidden, intermediate))):
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, output_dim=0, input_dim=1)  # within one expert's [out, in]
            layer.register_parameter(name, param)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return run_routed(layer, x, topk_weights, topk_ids, *self.products(layer), _bf16_grouped(layer, x))

    def products(self, layer: nn.Module) -> tuple[Callable[[int], ExpertProduct], Callable[[int], ExpertProduct]]:
        """Each expert's gate/up and down products, one call per expert."""
        return (lambda e: lambda rows: F.linear(rows, layer.w13_weight[e]),
                lambda e: lambda rows: F.linear(rows, layer.w2_weight[e]))


def _bf16_grouped(layer: nn.Module, x: torch.Tensor) -> Optional[GroupedProducts]:
    """The few-row kernel on the stacked bf16 weights, where it runs (else None)."""
    kernel = bf16_linear_kernel()
    if kernel is None or not x.is_cpu or x.dtype != torch.bfloat16 or layer.w13_weight.dtype != torch.bfloat16:
        return None

    def product(weights: torch.Tensor) -> ExpertsProduct:
        return lambda rows, experts: ops.call(kernel.experts, torch.ops.octavo.bf16_linear_experts, rows, weights,
                                              experts)

    return GroupedProducts(product(layer.w13_weight), product(layer.w2_weight), BF16_EXPERT_ROWS)


# One expert's gate/up or down product on the kernels (on the fly: int8, int4 or W8A8; a
# pre-quantized checkpoint's may also be dequantized, see prequantized_weight.py).
QuantizedExpert = KernelWeight


@dataclass
class QuantizedExperts:
    """Every expert's two products as quantized weights, for the linear kernels, and both as grouped
    products where the experts kernels take them (None elsewhere): ``grouped`` at few rows, ``many``
    (bf16 rows) beyond."""

    gate_up: list[QuantizedExpert]
    down: list[QuantizedExpert]
    grouped: Optional[GroupedProducts] = field(init=False)
    many: Optional[GroupedProducts] = field(init=False)

    def __post_init__(self) -> None:
        qdot = GroupedProduct.of(self.gate_up), GroupedProduct.of(self.down)
        amx = GroupedProduct.of(self.gate_up, amx=True), GroupedProduct.of(self.down, amx=True)
        self.grouped = self.many = None
        if None not in amx:
            # bf16 rows on AMX tiles past the rows the integer dot products take: the same sums as one call
            # per expert there (a dense layer's rows past FMA_ROWS go to AMX tiles too).
            rows = FMA_ROWS if None in qdot else qdot_rows_per_expert(qdot, amx)
            self.many = GroupedProducts(*amx, max_rows=sys.maxsize, min_rows=rows + 1)
        if None not in qdot:
            # Up to QDOT_ROWS rows a per-expert product takes the same kernel's path: the same sums; where the
            # AMX call exists, as many rows as measured faster than it.
            self.grouped = GroupedProducts(*qdot, QDOT_ROWS if self.many is None else self.many.min_rows - 1)


# Rows per expert at which a layer times the integer dot products on int8 rows against bf16 rows on AMX tiles
# (each bucket standing for the rows up to it): the dot products read each weight once per 4 rows, the AMX
# call dequantizes each 32-output group once for all of an expert's rows, so the first wins at few rows and
# the second past some count that depends on the CPU and the shape (Qwen3-30B-A3B's layer in int4, one
# thread, CPU time: 2.2x / 1.14x / 0.73x at 8 / 16 / 32 rows per expert).
EXPERT_ROW_BUCKETS = (8, 16, 32)
# Experts a measurement spreads its rows over: enough that the weights stream from memory, as at decode.
MEASURED_EXPERTS = 16


def qdot_rows_per_expert(qdot: tuple[GroupedProduct, GroupedProduct], amx: tuple[GroupedProduct, GroupedProduct]
                         ) -> int:
    """The most rows per expert up to which the (gate/up, down) calls ``qdot`` were measured faster than
    ``amx`` (at least QDOT_ROWS): the measured table (quant/linear_table.py) times both on this layer's experts
    at each of ``EXPERT_ROW_BUCKETS`` rows per expert, once per shape on this CPU."""
    first = qdot[0].weights[0]
    count = len(qdot[0].weights)
    hidden, intermediate = first.in_features, qdot[1].weights[0].in_features
    key = (f"experts:int{first.bits}g{first.group_size}{'z' if first.mins is not None else ''}:"
           f"{count}x{first.out_features}x{hidden}:bfloat16")

    def ways_at(rows: int) -> dict[str, Callable[[], object]]:
        used = min(count, MEASURED_EXPERTS)
        experts = (torch.arange(used) * (count // used)).repeat_interleave(rows)
        x = torch.randn(len(experts), hidden).to(torch.bfloat16)
        h = torch.randn(len(experts), intermediate).to(torch.bfloat16)
        return {name: lambda p=products: (p[0](x, experts), p[1](h, experts))
                for name, products in (("qdot", qdot), ("amx", amx))}

    ways = shared_table().choose(key, EXPERT_ROW_BUCKETS, ways_at)
    rows = QDOT_ROWS
    for bucket in EXPERT_ROW_BUCKETS:
        if ways[bucket] != "qdot":
            break
        rows = bucket
    return rows


class QuantizedExpertsMethod(FusedMoEMethod, ABC):
    """Experts run on the linear kernels: what a subclass prepares after loading is the layer's
    ``QuantizedExperts``."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        experts: QuantizedExperts = layer.prepared
        grouped = experts.grouped if x.is_cpu and QdotLinearKernel.supports(x.dtype) else None
        many = experts.many if x.is_cpu and x.dtype == torch.bfloat16 else None
        return run_routed(layer, x, topk_weights, topk_ids, *self.products(layer), grouped, many)

    def products(self, layer: nn.Module) -> tuple[Callable[[int], ExpertProduct], Callable[[int], ExpertProduct]]:
        """Each expert's gate/up and down products, one call per expert."""
        experts: QuantizedExperts = layer.prepared
        return lambda e: experts.gate_up[e], lambda e: experts.down[e]

    def kernel_name(self, layer: nn.Module) -> str:
        return f"{layer.prepared.gate_up[0].kernel_name()} (experts)"

    def weight_bytes(self, layer: nn.Module) -> int:
        experts: QuantizedExperts = layer.prepared
        return sum(w.nbytes for w in (*experts.gate_up, *experts.down))


class QuantizedMoEMethod(QuantizedExpertsMethod):
    """Experts loaded in float, then each expert's gate/up and down quantized as a linear layer's
    weight is (``quantize``: a weight [out, in] -> the kernels' weight); the float copies are released."""

    def __init__(self, quantize: Callable[[torch.Tensor], QuantizedExpert],
                 check_in_features: Callable[[int, str], None], prefix: str) -> None:
        """``check_in_features(n, where)``: raises where the quantization cannot cut ``n`` in-features
        (int4's groups); ``prefix``: the experts' checkpoint path, for that error."""
        self.quantize, self.check_in_features, self.prefix = quantize, check_in_features, prefix

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        # Before any weight exists: the in-features are the gate/up products' hidden and this rank's
        # share of the down products' intermediate features.
        self.check_in_features(hidden, f"{self.prefix} (gate and up)")
        self.check_in_features(intermediate, f"{self.prefix} (down)")
        UnquantizedMoEMethod().create_weights(layer, num_experts, hidden, intermediate, dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> PreparedWeight:
        experts = QuantizedExperts([self.quantize(w) for w in layer.w13_weight.detach()],
                                   [self.quantize(w) for w in layer.w2_weight.detach()])
        return PreparedWeight(experts, released=("w13_weight", "w2_weight"))
