"""GPTQ checkpoints as AutoGPTQ, GPTQModel and optimum write them.

Layout (AutoGPTQ ``nn_modules/qlinear`` ``QuantLinear.pack``, GPTQModel
``PackableQuantLinear``), for a layer of K input and N output features,
``pack = 32 // bits`` and G = ceil(K / group_size) groups (1 for
group_size -1):

- ``qweight`` int32 [K / pack, N]: packed along the INPUT dim; word row r,
  field f (bits f*bits ...) holds input feature r * pack + f.
- ``qzeros`` int32 [G, N / pack]: packed along the OUTPUT dim, same field order.
  ``checkpoint_format`` "gptq" (v1, the default and what both tools save)
  stores each zero point minus one; "gptq_v2" stores it as is. A v1 field
  therefore decodes to ``stored + 1``, which may be 2**bits (a true zero
  point 0 wrapped to all ones when saved; the reference kernels read it
  back as 2**bits too, and so does this loader).
- ``scales`` float16 [G, N].
- ``g_idx`` int32 [K]: the group of each input feature; ``k // group_size``
  unless ``desc_act`` (act-order) scattered them.
- ``bias`` [N] when the layer has one (loaded by the layer as usual).

W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n].

Under tensor parallelism ``qweight`` and ``g_idx`` are split with the input
features, ``qzeros``/``scales`` are kept whole (an act-order rank's
features belong to any group) and each rank keeps the groups its ``g_idx``
names.
"""
from __future__ import annotations

import torch

from octavo.quant.formats.base import LayerShape, PackedFormat, TensorSpec, group_index
from octavo.quant.formats.int_weight import IntWeight, with_group_index
from octavo.quant.formats.packing import unpack_int32

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GptqFormat(PackedFormat):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, checkpoint_format: str = "gptq") -> None:
        super().__init__(bits, group_size)
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r}: supported {CHECKPOINT_FORMATS}")
        # v1 stores zero points minus one.
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0

    def tensors(self, shape: LayerShape) -> list[TensorSpec]:
        k, n, groups = shape.in_features, shape.out_features, self.groups_all(shape)
        self.check_packs((k,), "input features")
        self.check_packs(shape.out_sizes, "output features")
        return [
            TensorSpec("qweight", (k // self.pack, n), torch.int32, output_dim=1, input_dim=0),
            TensorSpec("qzeros", (groups, n // self.pack), torch.int32, output_dim=1, input_dim=None,
                       packed_dim=1, pack_factor=self.pack),
            # float32 holds fp16 and bf16 scales exactly.
            TensorSpec("scales", (groups, n), torch.float32, output_dim=1, input_dim=None),
            self.group_index_spec("g_idx", shape),
        ]

    def unpack(self, tensors: dict[str, torch.Tensor], shape: LayerShape) -> IntWeight:
        q = unpack_int32(tensors["qweight"], self.bits, dim=0).T
        zeros = unpack_int32(tensors["qzeros"], self.bits, dim=1).T.to(torch.int32) + self.zero_offset
        return with_group_index(q, tensors["scales"].T, zeros, group_index(tensors["g_idx"]),
                                self.effective_group(shape), self.bits)
