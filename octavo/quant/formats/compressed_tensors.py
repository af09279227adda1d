"""compressed-tensors checkpoints with integer weights: ``pack-quantized``
(llm-compressor's W4A16 / W8A16 output) and ``int-quantized`` (its W8A8
output: int8 weights whose layers round their inputs to int8 per token,
``int8_activations``).

Layout (compressed-tensors ``compressors/quantized_compressors/pack_quantized.py``
``pack_to_int32`` and ``compression_param_info``), for a module of N output
and K input features, ``pack = 32 // num_bits``:

- ``weight_packed`` int32 [N, K / pack]: packed along the INPUT dim, field f
  of word c holding input feature ``c * pack + f``. Values are signed
  (-2**(bits-1) .. 2**(bits-1) - 1) stored plus 2**(bits-1).
- ``weight_scale`` [N, G] in the model's dtype: G = K / group_size for
  strategy "group", 1 for "channel".
- ``weight_zero_point`` int32 [N / pack, G], only when asymmetric: packed
  along the OUTPUT dim (dim 0), same signed-plus-offset values. Symmetric
  layers store none (zero point 0).
- ``weight_g_idx`` int32 [K] only for ``actorder: group`` (group of each input feature).
- ``weight_shape`` int64 [2]: the unpacked [N, K].

W = (q_signed - zero_signed) * scale, which is the same as the difference
of the stored unsigned values; this loader keeps those.

``int-quantized`` (``naive_quantized.py``, ``NaiveQuantizationCompressor``)
stores the signed values unpacked: ``weight`` int8 [N, K] and
``weight_scale`` [N, 1] (strategy "channel"); symmetric layers store no zero
point, and dynamic activations no input scale.
"""
from __future__ import annotations

import torch

from octavo.quant.formats.base import LayerShape, PackedFormat, TensorSpec, group_index
from octavo.quant.formats.int_weight import IntWeight, with_group_index
from octavo.quant.formats.packing import unpack_int32


class PackQuantizedFormat(PackedFormat):
    name = "compressed-tensors"

    def __init__(self, bits: int, group_size: int, symmetric: bool, group_index: bool,
                 int8_activations: bool = False) -> None:
        super().__init__(bits, group_size)
        self.symmetric, self.group_index, self.int8_activations = symmetric, group_index, int8_activations

    def tensors(self, shape: LayerShape) -> list[TensorSpec]:
        k, n = shape.in_features, shape.out_features
        self.check_packs((k,), "input features")
        if self.group_index:  # act-order: whole on every rank, like GPTQ's
            groups, group_dim = self.groups_all(shape), None
        else:
            groups, group_dim = self.groups_here(shape), (None if self.group_size == -1 else 1)
        specs = [
            TensorSpec("weight_packed", (n, k // self.pack), torch.int32, output_dim=0, input_dim=1),
            TensorSpec("weight_scale", (n, groups), torch.float32, output_dim=0, input_dim=group_dim),
            # Every fused part's [N_part, K] lands here in turn; only K is checked.
            TensorSpec("weight_shape", (2,), torch.int64, output_dim=None, input_dim=None),
        ]
        if not self.symmetric:
            self.check_packs(shape.out_sizes, "output features (zero points)")
            specs.append(TensorSpec("weight_zero_point", (n // self.pack, groups), torch.int32, output_dim=0,
                                    input_dim=group_dim, packed_dim=0, pack_factor=self.pack))
        if self.group_index:
            specs.append(self.group_index_spec("weight_g_idx", shape))
        return specs

    def unpack(self, tensors: dict[str, torch.Tensor], shape: LayerShape) -> IntWeight:
        stored = int(tensors["weight_shape"][1])
        if stored != shape.full_in_features:
            raise ValueError(f"weight_shape says {stored} input features; the model has {shape.full_in_features}")
        q = unpack_int32(tensors["weight_packed"], self.bits, dim=1)
        scales = tensors["weight_scale"]
        if self.symmetric:
            zeros = torch.full(scales.shape, 1 << (self.bits - 1), dtype=torch.int32)
        else:
            zeros = unpack_int32(tensors["weight_zero_point"], self.bits, dim=0).to(torch.int32)
        group = self.effective_group(shape)
        if self.group_index:
            return with_group_index(q, scales, zeros, group_index(tensors["weight_g_idx"]), group, self.bits)
        return IntWeight(q, scales, zeros, self.bits, group)


class IntQuantizedFormat(PackedFormat):
    """``int-quantized``: int8 weights as stored, one symmetric scale per output channel."""

    name = "compressed-tensors int-quantized"

    def __init__(self, int8_activations: bool) -> None:
        super().__init__(8, -1)
        self.int8_activations = int8_activations

    def tensors(self, shape: LayerShape) -> list[TensorSpec]:
        k, n = shape.in_features, shape.out_features
        return [
            TensorSpec("weight", (n, k), torch.int8, output_dim=0, input_dim=1),
            TensorSpec("weight_scale", (n, 1), torch.float32, output_dim=0, input_dim=None),
        ]

    def unpack(self, tensors: dict[str, torch.Tensor], shape: LayerShape) -> IntWeight:
        unsigned = (tensors["weight"] ^ -128).view(torch.uint8)  # q + 128: the same bits, top one flipped
        scales = tensors["weight_scale"]
        return IntWeight(unsigned, scales, torch.full(scales.shape, 128, dtype=torch.int32), 8, shape.in_features)
