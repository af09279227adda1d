"""GGUF's Q8_0, Q4_0 and Q4_1 blocks (llama.cpp) as int8 / int4 layers.

Each quantizes a row in blocks of 32 consecutive inputs with one float16
scale ``d`` per block:

- Q8_0: 32 signed bytes q, w = d * q;
- Q4_0: 16 bytes of nibbles (the low nibbles are inputs 0-15 of the block,
  the high ones 16-31), values 0..15, w = d * (q - 8);
- Q4_1: a float16 minimum ``m`` too, then Q4_0's nibbles, w = d * q + m.

So they are the kernels' own group-32 formats: int8 symmetric, int4 with
zero point 8, int4 with a float offset per group (the kernels compute
q * scale + min, so ``m`` is taken as it is). The GGUF reader
(octavo/model/gguf/tensors.py) splits the blocks into one value per input
(``qweight`` [N, K]: int8 for Q8_0, uint8 0..15 for Q4_0/Q4_1), the scales
(``scales`` [N, K / 32] float32) and Q4_1's minimums (``mins``, alike), so
the tensors split across ranks and fused parts like any [N, K] weight.
"""
from __future__ import annotations

import torch

from octavo.quant.formats.base import LayerShape, PackedFormat, TensorSpec
from octavo.quant.formats.int_weight import IntWeight

GGUF_BLOCK = 32
GGUF_TYPES = {"q8_0": 8, "q4_0": 4, "q4_1": 4}
WITH_MINS = ("q4_1",)


class GgufBlockFormat(PackedFormat):
    name = "gguf"

    def __init__(self, type_name: str) -> None:
        super().__init__(GGUF_TYPES[type_name], GGUF_BLOCK)
        self.type_name = type_name

    def tensors(self, shape: LayerShape) -> list[TensorSpec]:
        k, n = shape.in_features, shape.out_features
        dtype = torch.int8 if self.bits == 8 else torch.uint8
        groups = (n, self.groups_here(shape))
        return [
            TensorSpec("qweight", (n, k), dtype, output_dim=0, input_dim=1),
            *(TensorSpec(name, groups, torch.float32, output_dim=0, input_dim=1) for name in self.group_tensors()),
        ]

    def group_tensors(self) -> tuple[str, ...]:
        """The per-block float tensors of this type, as the reader splits them out."""
        return ("scales", "mins") if self.type_name in WITH_MINS else ("scales",)

    def unpack(self, tensors: dict[str, torch.Tensor], shape: LayerShape) -> IntWeight:
        q, scales = tensors["qweight"], tensors["scales"]
        if self.type_name in WITH_MINS:
            return IntWeight(q, scales, None, self.bits, self.group_size, mins=tensors["mins"])
        # The canonical form holds unsigned values with a zero point: Q8_0's
        # signed bytes become q + 128 (the same bits, top bit flipped), zero 128.
        unsigned = (q.view(torch.uint8) ^ 0x80) if self.bits == 8 else q
        zero = 1 << (self.bits - 1)
        zeros = torch.full(scales.shape, zero, dtype=torch.int32)
        return IntWeight(unsigned, scales, zeros, self.bits, self.group_size)

    def describe(self) -> str:
        return f"gguf {self.type_name.upper()} (int{self.bits} group {GGUF_BLOCK})"
