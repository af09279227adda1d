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
"""
from __future__ import annotations

from typing import Mapping, Union

import torch
from torch import nn

from octavo.quant.base import FusedMoEMethod, LinearMethod, PreparedWeight, QuantizationScheme, set_weight_attrs
from octavo.quant.checkpoint_config import CheckpointQuantization
from octavo.quant.formats.base import LayerShape, PackedFormat
from octavo.quant.prequantized_weight import kernel_weight
from octavo.quant.quantized import QuantizedLinearMethod


class PrequantizedLinearMethod(QuantizedLinearMethod):
    """Loads a layer stored in ``fmt``, then hands its integers to the int8/int4 (or W8A8) kernels."""

    def __init__(self, fmt: PackedFormat) -> None:
        self.fmt = fmt

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        shape = LayerShape(input_size, tuple(output_sizes), getattr(layer, "input_shards", 1))
        for spec in self.fmt.tensors(shape):
            param = nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False)
            set_weight_attrs(param, output_dim=spec.output_dim, input_dim=spec.input_dim)
            if spec.packed_dim is not None:
                set_weight_attrs(param, packed_dim=spec.packed_dim, pack_factor=spec.pack_factor)
            if spec.per_part:
                set_weight_attrs(param, per_part=True)
            layer.register_parameter(spec.name, param)
        layer.quant_shape, layer.quant_dtype = shape, dtype

    def process_weights_after_loading(self, layer: nn.Module) -> PreparedWeight:
        """Unpack the checkpoint's tensors and install the kernels' weight in their place."""
        names = tuple(spec.name for spec in self.fmt.tensors(layer.quant_shape))
        try:
            weight = self.fmt.unpack({name: getattr(layer, name).data for name in names}, layer.quant_shape)
        except ValueError as exc:
            raise ValueError(f"{self.fmt.describe()} layer {getattr(layer, 'prefix', '')}: {exc}") from exc
        return self.prepared(kernel_weight(weight, layer.quant_dtype, self.fmt.int8_activations), names)

    def kernel_name(self, layer: nn.Module) -> str:
        return f"{self.fmt.describe()}: {super().kernel_name(layer)}"


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

    def moe_method(self, prefix: str) -> FusedMoEMethod:
        # Quantized expert tensors are not read yet: such a checkpoint fails at load, naming them.
        return self.base.moe_method(prefix)

    def linear_method(self, prefix: str) -> LinearMethod:
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{part}" if parent else part for part in self.parts.get(leaf, [leaf])]
        formats = [self.quantization.format_for(name) for name in names]
        if any(fmt is not formats[0] for fmt in formats):
            described = {n: (f.describe() if f else "unquantized") for n, f in zip(names, formats)}
            raise ValueError(f"{self.quantization.method} checkpoint: the parts of {prefix} are stored "
                             f"differently ({described}); they run as one fused layer, so they must match")
        fmt = formats[0]
        if fmt is None:
            return self.base.linear_method(prefix)
        if leaf == "lm_head":
            raise ValueError(f"{self.quantization.method} checkpoint: a quantized lm_head is not supported; "
                             "supported: lm_head unquantized (GPTQ lm_head false, compressed-tensors "
                             "ignore: [lm_head])")
        return self._methods.setdefault(id(fmt), PrequantizedLinearMethod(fmt))

    def describe(self) -> str:
        return f"{self.quantization.method} checkpoint; other layers: {self.base.describe()}"
