"""The quantization seam: how a linear layer's weights are stored and multiplied.

A parallel linear layer knows how its weight is split across ranks; a
``LinearMethod`` knows what the weight *is* (bf16, int8 with scales, packed
int4 ...) and which kernel multiplies it. The layer hands the method its
per-rank shape, the checkpoint fills the parameters the method created
(through the layer's ``weight_loader``), the method then repacks them once
for its kernel, and every forward goes through ``apply``. One method object
serves every layer it is given to: what it derives per layer after loading is
one object it returns (``PreparedWeight``), which the layer keeps in its
``prepared`` slot; a method sets no attribute on a layer.

Which method a layer gets is the ``QuantizationScheme``'s choice, per layer,
by the layer's ``prefix``: its module path as in the checkpoint
(``model.layers.0.self_attn.qkv_proj``, ``model.layers.3.mlp.down_proj``,
``lm_head``; fused layers carry the fused name, their parts' tensors arrive
through ``packed_modules_mapping``). A scheme for a pre-quantized checkpoint
returns methods whose ``create_weights`` register the checkpoint's tensors
(qweight, qzeros, scales, g_idx ...) and whose
``process_weights_after_loading`` repacks them for a kernel
(octavo/quant/qweights.py has the kernels' canonical inputs).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Tag a parameter for the layers' weight loaders: ``output_dim`` /
    ``input_dim`` name the dims that are split across ranks (None: not split).
    A parameter that stores several values per element along its output dim
    (int4 nibbles in int32: GPTQ's qzeros, AWQ's qweight) also says
    ``packed_dim`` (that dim) and ``pack_factor`` (values per element): fused
    layers then place each part at ``offset / pack_factor`` along it. Packing
    along the input dim needs nothing: the loader only cuts equal pieces
    there, sized by the parameter."""
    for name, value in attrs.items():
        setattr(param, name, value)


@dataclass(frozen=True)
class PreparedWeight:
    """What a method derived from a layer's loaded parameters for its kernel."""

    kernel_weight: Any  # the method's own object (a prepacked weight, a quantized weight ...)
    # Parameters the kernel no longer reads: they keep their names (and shapes) on the meta
    # device for the loader's bookkeeping, their memory freed.
    released: tuple[str, ...] = ()


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        """Register ``layer``'s weight parameters for this rank's shard: an
        ``input_size`` x ``sum(output_sizes)`` product, ``output_sizes`` being
        the fused parts (q/k/v, gate/up) in order. Each parameter carries
        ``output_dim`` and ``input_dim`` (``set_weight_attrs``) so the layer's
        loader knows where to put a checkpoint's shard; the layer adds the
        loader itself. Bias is the layer's, never quantized."""

    def process_weights_after_loading(self, layer: nn.Module) -> Optional[PreparedWeight]:
        """Called once per layer (``LinearWeightHolder.finish_loading``) when every parameter holds
        its checkpoint values: what the kernel reads instead of them, if anything; None: ``apply``
        multiplies the parameters as loaded."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x @ W^T + bias`` for ``x`` [..., input_size] with ``layer``'s
        weight: [..., sum(output_sizes)] in ``x``'s dtype."""

    @abstractmethod
    def kernel_name(self, layer: nn.Module) -> str:
        """Which kernel multiplies ``layer``'s weight (for the start-up log and tests)."""

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes of ``layer``'s weight as its kernel holds it (for the
        start-up log): by default its parameters' shapes, bias excluded."""
        return sum(p.numel() * p.element_size() for name, p in layer.named_parameters(recurse=False)
                   if name != "bias")


class FusedMoEMethod(ABC):
    """How one layer's experts are stored and applied: the parameters for this rank's shard (every
    expert's gate and up projections fused in ``w13_weight`` [experts, 2 * intermediate, hidden],
    the down projections in ``w2_weight`` [experts, hidden, intermediate]; a pre-quantized format's
    tensors likewise, ``w13_<tensor>`` / ``w2_<tensor>`` stacked per expert), what the kernel reads
    after loading, and the products for tokens already routed (each token's ``top_k`` experts and
    their weights). The layer is a ``LinearWeightHolder``: it keeps ``prepared``."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        """Register ``w13_<tensor>`` and ``w2_<tensor>`` on ``layer`` (``intermediate``: this rank's
        share; ``<tensor>``: what the checkpoint calls each expert's tensor, ``weight`` for float),
        each with ``output_dim`` / ``input_dim`` (``set_weight_attrs``) counted within one expert,
        for the experts' loader to split them as a gated MLP's."""

    def process_weights_after_loading(self, layer: nn.Module) -> Optional[PreparedWeight]:
        """As ``LinearMethod``'s: what the experts' kernel reads instead of the loaded parameters."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """sum over k of ``topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for x [tokens, hidden]."""

    def kernel_name(self, layer: nn.Module) -> str:
        return "torch (experts)"

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


class QuantizationScheme(ABC):
    """Chooses each linear layer's ``LinearMethod`` by its ``prefix`` (module
    path as in the checkpoint). One scheme per model; schemes are cheap to
    ask: layers call ``linear_method`` once each, at construction."""

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the layer at ``prefix``: the same object may serve
        many layers (it keeps per-layer state on the layer)."""

    def moe_method(self, prefix: str, names: tuple[str, str, str], num_experts: int) -> FusedMoEMethod:
        """The method for the experts of the mixture at ``prefix`` (``model.layers.0.mlp.experts``):
        ``num_experts`` modules ``<prefix>.<expert>``, each with a gate, an up and a down projection
        the checkpoint calls ``names``."""
        raise ValueError(f"{self.describe()} has no method for a mixture of experts ({prefix})")

    def describe(self) -> str:
        """One line for the start-up log."""
        return type(self).__name__


class LinearWeightHolder(nn.Module):
    """A module whose weights a method creates and multiplies (a ``LinearMethod``: the linear layers,
    the LM head; a ``FusedMoEMethod``: a mixture's experts). ``prepared``: the method's
    ``PreparedWeight.kernel_weight`` once loaded, else None."""

    linear_method: LinearMethod
    prepared: Any = None

    @property
    def weight_method(self) -> LinearMethod | FusedMoEMethod:
        return self.linear_method

    def finish_loading(self) -> None:
        """Let the method prepare the loaded weight for its kernel; free what the kernel no longer reads."""
        prepared = self.weight_method.process_weights_after_loading(self)
        if prepared is None:
            return
        self.prepared = prepared.kernel_weight
        for name in prepared.released:
            setattr(self, name, nn.Parameter(getattr(self, name).detach().to("meta"), requires_grad=False))
