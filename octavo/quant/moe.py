"""The mixture-of-experts methods (the seam, ``FusedMoEMethod``, is in quant/base.py beside
``LinearMethod``): float experts, and experts quantized on the fly to int8 / int4 / w8a8 on the
linear kernels.

Both run the same way: the (token, choice) pairs are sorted by expert, so each expert's rows are
one contiguous slice; one gate/up product, the activation and one down product per expert that has
rows, then a weighted scatter-add back to the tokens. Experts no token chose cost nothing and their
weights are never read (at batch 1 only ``top_k`` experts' bytes are)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch
from torch import nn
from torch.nn import functional as F

from octavo.quant.base import FusedMoEMethod, PreparedWeight
from octavo.quant.qweights import QuantizedWeight
from octavo.quant.w8a8 import W8A8Weight

# One expert's product: rows [n, in] -> [n, out].
ExpertProduct = Callable[[torch.Tensor], torch.Tensor]


def run_routed(layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               gate_up: Callable[[int], ExpertProduct], down: Callable[[int], ExpertProduct]) -> torch.Tensor:
    """sum over k of ``topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])``, each expert's products
    given by ``gate_up(e)`` and ``down(e)`` (``e`` counted from the layer's ``expert_start``). The
    pairs routed to experts the layer does not hold (another rank's, under expert parallelism) are
    left out: their tokens get nothing from here."""
    top_k = topk_ids.shape[1]
    local = topk_ids.flatten() - layer.expert_start
    pairs = None  # which (token, choice) pairs run here: all of them
    if layer.num_experts < layer.total_experts:
        pairs = ((local >= 0) & (local < layer.num_experts)).nonzero().flatten()
        local = local.index_select(0, pairs)
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=layer.num_experts)
    if pairs is not None:
        order = pairs.index_select(0, order)  # back to indices of the (token, choice) pairs
    rows_of = order // top_k  # the token of each sorted (token, choice) pair
    routed = x.index_select(0, rows_of)
    out = torch.empty_like(routed)
    start = 0
    for expert, count in zip(counts.nonzero().flatten().tolist(), counts[counts > 0].tolist()):
        rows = slice(start, start + count)
        gate, up = gate_up(expert)(routed[rows]).chunk(2, dim=-1)
        out[rows] = down(expert)(layer.activation(gate) * up)
        start += count
    out.mul_(topk_weights.flatten().index_select(0, order).unsqueeze(1).to(out.dtype))
    return torch.zeros_like(x).index_add_(0, rows_of, out)


class UnquantizedMoEMethod(FusedMoEMethod):
    """Float experts, multiplied by ``F.linear`` on each expert's slice of the weights."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        for name, shape in (("w13_weight", (num_experts, 2 * intermediate, hidden)),
                            ("w2_weight", (num_experts, hidden, intermediate))):
            layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return run_routed(layer, x, topk_weights, topk_ids,
                          lambda e: lambda rows: F.linear(rows, layer.w13_weight[e]),
                          lambda e: lambda rows: F.linear(rows, layer.w2_weight[e]))


QuantizedExpert = Union[QuantizedWeight, W8A8Weight]


@dataclass
class QuantizedExperts:
    """Every expert's two products as quantized weights, for the linear kernels."""

    gate_up: list[QuantizedExpert]
    down: list[QuantizedExpert]


class QuantizedMoEMethod(UnquantizedMoEMethod):
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
        super().create_weights(layer, num_experts, hidden, intermediate, dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> PreparedWeight:
        experts = QuantizedExperts([self.quantize(w) for w in layer.w13_weight.detach()],
                                   [self.quantize(w) for w in layer.w2_weight.detach()])
        return PreparedWeight(experts, released=("w13_weight", "w2_weight"))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        experts: QuantizedExperts = layer.prepared
        return run_routed(layer, x, topk_weights, topk_ids, lambda e: experts.gate_up[e], lambda e: experts.down[e])

    def kernel_name(self, layer: nn.Module) -> str:
        return f"{layer.prepared.gate_up[0].kernel_name()} (experts)"

    def weight_bytes(self, layer: nn.Module) -> int:
        experts: QuantizedExperts = layer.prepared
        return sum(w.nbytes for w in (*experts.gate_up, *experts.down))
