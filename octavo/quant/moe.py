"""The mixture-of-experts seam beside ``LinearMethod``: how one layer's experts are stored and applied.

A ``FusedMoEMethod`` creates the experts' parameters for this rank's shard (every expert's gate and
up projections fused in ``w13`` [experts, 2 * intermediate, hidden], the down projections in ``w2``
[experts, hidden, intermediate]), may prepare them for its kernel after loading, and applies them
to tokens already routed: each token's ``top_k`` experts and their weights."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.quant.base import PreparedWeight


class FusedMoEMethod(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        """Register ``w13_weight`` and ``w2_weight`` on ``layer`` (``intermediate``: this rank's share)."""

    def process_weights_after_loading(self, layer: nn.Module) -> Optional[PreparedWeight]:
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """sum over k of ``topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for x [tokens, hidden]."""


class UnquantizedMoEMethod(FusedMoEMethod):
    """Float experts, multiplied expert by expert over the rows routed to each.

    The (token, choice) pairs are sorted by expert, so each expert's rows are one contiguous slice:
    one gate/up product, the activation and one down product per expert that has rows, then a
    weighted scatter-add back to the tokens. Experts no token chose cost nothing and their weights
    are never read (at batch 1 only ``top_k`` experts' bytes are)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        for name, shape in (("w13_weight", (num_experts, 2 * intermediate, hidden)),
                            ("w2_weight", (num_experts, hidden, intermediate))):
            layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        tokens, top_k = topk_ids.shape
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=layer.w13_weight.shape[0])
        rows_of = order // top_k  # the token of each sorted (token, choice) pair
        routed = x.index_select(0, rows_of)
        out = torch.empty_like(routed)
        start = 0
        for expert, count in zip(counts.nonzero().flatten().tolist(), counts[counts > 0].tolist()):
            rows = slice(start, start + count)
            gate, up = F.linear(routed[rows], layer.w13_weight[expert]).chunk(2, dim=-1)
            out[rows] = F.linear(layer.activation(gate) * up, layer.w2_weight[expert])
            start += count
        out.mul_(topk_weights.flatten().index_select(0, order).unsqueeze(1).to(out.dtype))
        return torch.zeros_like(x).index_add_(0, rows_of, out)
