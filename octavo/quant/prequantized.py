"""Linear layers whose checkpoint is already quantized (GPTQ, AWQ,
compressed-tensors): the checkpoint's own tensors are the layer's
parameters, so they load (and split across ranks and fused parts) through
the layers' usual weight loaders, and are repacked once after loading into
what a kernel reads.

The scheme asks the checkpoint's ``quantization_config`` about every linear
layer by its checkpoint name; a fused layer (``qkv_proj``) asks for each of
its parts (``q_proj``, ``k_proj``, ``v_proj``), which must agree. A layer
the checkpoint leaves unquantized (lm_head, ``modules_to_not_convert``,
``ignore``) gets the method the scheme underneath gives it.

A mixture's experts are asked about the same way, expert by expert
(``model.layers.0.mlp.experts.3.gate_proj``): each expert's tensors are a
linear layer's in the same format, stacked on a leading expert dim, and
every expert then runs on the same kernels as a linear layer.
"""
from __future__ import annotations

from typing import Mapping, Optional, Union

import torch
from torch import nn

from octavo.quant.base import FusedMoEMethod, LinearMethod, PreparedWeight, QuantizationScheme, set_weight_attrs
from octavo.quant.checkpoint_config import CheckpointQuantization
from octavo.quant.formats.base import LayerShape, PackedFormat
from octavo.quant.moe import QuantizedExpert, QuantizedExperts, QuantizedExpertsMethod
from octavo.quant.prequantized_weight import KernelWeight, kernel_weight
from octavo.quant.quantized import QuantizedLinearMethod


def _register_tensors(layer: nn.Module, fmt: PackedFormat, shape: LayerShape, prefix: str = "",
                      experts: Optional[int] = None) -> None:
    """``fmt``'s tensors for a layer of ``shape`` as parameters ``<prefix><name>`` of ``layer``;
    ``experts``: stacked, one per expert on a leading dim (the split attributes count the dims
    within one expert)."""
    for spec in fmt.tensors(shape):
        size = spec.shape if experts is None else (experts, *spec.shape)
        param = nn.Parameter(torch.empty(size, dtype=spec.dtype), requires_grad=False)
        set_weight_attrs(param, output_dim=spec.output_dim, input_dim=spec.input_dim)
        if spec.packed_dim is not None:
            set_weight_attrs(param, packed_dim=spec.packed_dim, pack_factor=spec.pack_factor)
        if spec.per_part:
            set_weight_attrs(param, per_part=True)
        layer.register_parameter(prefix + spec.name, param)


def _kernel_weight(fmt: PackedFormat, tensors: dict[str, torch.Tensor], shape: LayerShape, dtype: torch.dtype,
                   where: str) -> KernelWeight:
    """The loaded tensors of one layer (by ``TensorSpec.name``) unpacked for the kernels."""
    try:
        weight = fmt.unpack(tensors, shape)
    except ValueError as exc:
        raise ValueError(f"{fmt.describe()} layer {where}: {exc}") from exc
    return kernel_weight(weight, dtype, fmt.int8_activations)


class PrequantizedLinearMethod(QuantizedLinearMethod):
    """Loads a layer stored in ``fmt``, then hands its integers to the int8/int4 (or W8A8) kernels."""

    def __init__(self, fmt: PackedFormat) -> None:
        self.fmt = fmt

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        shape = LayerShape(input_size, tuple(output_sizes), getattr(layer, "input_shards", 1))
        _register_tensors(layer, self.fmt, shape)
        layer.quant_shape, layer.quant_dtype = shape, dtype

    def process_weights_after_loading(self, layer: nn.Module) -> PreparedWeight:
        """Unpack the checkpoint's tensors and install the kernels' weight in their place."""
        names = tuple(spec.name for spec in self.fmt.tensors(layer.quant_shape))
        weight = _kernel_weight(self.fmt, {name: getattr(layer, name).data for name in names}, layer.quant_shape,
                                layer.quant_dtype, getattr(layer, "prefix", ""))
        return self.prepared(weight, names)

    def kernel_name(self, layer: nn.Module) -> str:
        return f"{self.fmt.describe()}: {super().kernel_name(layer)}"


class PrequantizedMoEMethod(QuantizedExpertsMethod):
    """A mixture's experts stored quantized, each expert's projections as a linear layer of its
    format (``experts.3.gate_proj.qweight`` ...): stacked as ``w13_<tensor>`` (gate and up, which run
    fused) and ``w2_<tensor>`` (down), they load through the experts' weight loader like float ones,
    then each expert is unpacked for the int8/int4 (or W8A8) kernels and the stacks released.
    ``gate_up`` and ``down``: the two sides' formats (a GGUF file may store them in different types)."""

    def __init__(self, gate_up: PackedFormat, down: PackedFormat) -> None:
        self.formats = {"w13": gate_up, "w2": down}

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        # Down splits its inputs (the intermediate features) across the tensor-parallel ranks.
        shapes = {"w13": LayerShape(hidden, (intermediate, intermediate)),
                  "w2": LayerShape(intermediate, (hidden,), layer.tp_size)}
        for side, fmt in self.formats.items():
            _register_tensors(layer, fmt, shapes[side], f"{side}_", num_experts)
        layer.quant_shape, layer.quant_dtype = shapes, dtype

    def process_weights_after_loading(self, layer: nn.Module) -> PreparedWeight:
        products: dict[str, list[QuantizedExpert]] = {}
        released: list[str] = []
        for side, fmt in self.formats.items():
            shape = layer.quant_shape[side]
            names = [spec.name for spec in fmt.tensors(shape)]
            products[side] = [
                _kernel_weight(fmt, {name: getattr(layer, f"{side}_{name}").data[e] for name in names}, shape,
                               layer.quant_dtype, f"expert {e} ({side})")
                for e in range(layer.num_experts)]
            released += [f"{side}_{name}" for name in names]
        return PreparedWeight(QuantizedExperts(products["w13"], products["w2"]), released=tuple(released))

    def kernel_name(self, layer: nn.Module) -> str:
        gate_up, down = self.formats["w13"], self.formats["w2"]
        stored = gate_up.describe() if down is gate_up else f"{gate_up.describe()}, down {down.describe()}"
        return f"{stored}: {super().kernel_name(layer)}"


class CheckpointScheme(QuantizationScheme):
    """Pre-quantized layers as ``quantization`` says, the rest from ``base``.

    ``fused_parts``: checkpoint module -> (fused module, shard id), the
    model's ``packed_modules_mapping``."""

    def __init__(
        self,
        quantization: CheckpointQuantization,
        fused_parts: Mapping[str, tuple[str, Union[int, str]]],
        base: QuantizationScheme,
    ) -> None:
        self.quantization, self.base = quantization, base
        self.parts: dict[str, list[str]] = {}
        for part, (fused, _) in fused_parts.items():
            self.parts.setdefault(fused, []).append(part)
        # One method per format: a method keeps its per-layer state on the layer.
        self._methods: dict[int, PrequantizedLinearMethod] = {}
        self._moe_methods: dict[tuple[int, int], PrequantizedMoEMethod] = {}

    def _one_format(self, prefix: str, modules: list[str]) -> Optional[PackedFormat]:
        """The format of ``modules``, which run as one fused product at ``prefix``; ValueError where they differ."""
        formats = [self.quantization.format_for(name) for name in modules]
        other = next((i for i, fmt in enumerate(formats) if fmt is not formats[0]), None)
        if other is not None:
            described = {n: (f.describe() if f else "unquantized") for n, f in
                         ((modules[0], formats[0]), (modules[other], formats[other]))}
            raise ValueError(f"{self.quantization.method} checkpoint: the parts of {prefix} are stored "
                             f"differently ({described}); they run as one fused layer, so they must match")
        return formats[0]

    def moe_method(self, prefix: str, names: tuple[str, str, str], num_experts: int) -> FusedMoEMethod:
        gate, up, down = names
        experts = range(num_experts)
        gate_up = self._one_format(prefix, [f"{prefix}.{e}.{part}" for e in experts for part in (gate, up)])
        down_fmt = self._one_format(prefix, [f"{prefix}.{e}.{down}" for e in experts])
        if gate_up is None and down_fmt is None:
            return self.base.moe_method(prefix, names, num_experts)
        if gate_up is None or down_fmt is None:
            raise ValueError(f"{self.quantization.method} checkpoint: the experts of {prefix} store "
                             f"{gate}/{up} {'unquantized' if gate_up is None else 'quantized'} but {down} "
                             f"{'unquantized' if down_fmt is None else 'quantized'}; supported: all of the "
                             "experts' projections quantized, or none")
        return self._moe_methods.setdefault((id(gate_up), id(down_fmt)), PrequantizedMoEMethod(gate_up, down_fmt))

    def linear_method(self, prefix: str) -> LinearMethod:
        parent, _, leaf = prefix.rpartition(".")
        fmt = self._one_format(prefix, [f"{parent}.{part}" if parent else part
                                        for part in self.parts.get(leaf, [leaf])])
        if fmt is None:
            return self.base.linear_method(prefix)
        if leaf == "lm_head":
            raise ValueError(f"{self.quantization.method} checkpoint: a quantized lm_head is not supported; "
                             "supported: lm_head unquantized (GPTQ lm_head false, compressed-tensors "
                             "ignore: [lm_head])")
        return self._methods.setdefault(id(fmt), PrequantizedLinearMethod(fmt))

    def describe(self) -> str:
        return f"{self.quantization.method} checkpoint; other layers: {self.base.describe()}"
