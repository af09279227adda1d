"""AWQ checkpoints in the GEMM layout (AutoAWQ ``WQLinear_GEMM``, the
layout transformers and llm-awq's exports use too), 4-bit only.

Layout (AutoAWQ ``awq/modules/linear/gemm.py`` ``from_linear``), for K
input and N output features, G = K / group_size:

- ``qweight`` int32 [K, N / 8]: packed along the OUTPUT dim, interleaved:
  field f (bits 4f .. 4f+3) of word c holds output feature
  ``8c + AWQ_ORDER[f]``, AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7) (its CUDA
  kernel dequantizes pairs of features at once this way).
- ``qzeros`` int32 [G, N / 8]: the same packing; zero points stored as they are.
- ``scales`` float16 [G, N].
- ``bias`` float16 [N] when the layer has one.

W[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n].
"""
from __future__ import annotations

import torch

from octavo.quant.formats.base import LayerShape, PackedFormat, TensorSpec
from octavo.quant.formats.int_weight import IntWeight
from octavo.quant.formats.packing import unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AwqFormat(PackedFormat):
    name = "awq"

    def tensors(self, shape: LayerShape) -> list[TensorSpec]:
        k, n = shape.in_features, shape.out_features
        self.check_packs(shape.out_sizes, "output features")
        groups = self.groups_here(shape)
        # Per-channel scales are the same on every rank; groups are split with the inputs.
        group_dim = None if self.group_size == -1 else 0
        return [
            TensorSpec("qweight", (k, n // self.pack), torch.int32, output_dim=1, input_dim=0,
                       packed_dim=1, pack_factor=self.pack),
            TensorSpec("qzeros", (groups, n // self.pack), torch.int32, output_dim=1, input_dim=group_dim,
                       packed_dim=1, pack_factor=self.pack),
            TensorSpec("scales", (groups, n), torch.float32, output_dim=1, input_dim=group_dim),
        ]

    def unpack(self, tensors: dict[str, torch.Tensor], shape: LayerShape) -> IntWeight:
        q = unpack_int32(tensors["qweight"], self.bits, dim=1, order=AWQ_ORDER).T
        zeros = unpack_int32(tensors["qzeros"], self.bits, dim=1, order=AWQ_ORDER).T.to(torch.int32)
        return IntWeight(q, tensors["scales"].T, zeros, self.bits, self.effective_group(shape))
