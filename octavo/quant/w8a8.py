"""W8A8: int8 weights times activations rounded to int8 on every call
(``--quantization w8a8``, compressed-tensors W8A8 checkpoints).

The weight is int8 per output channel, symmetric (w = q * scale_w[n]); each
row of the input (a token) is rounded to int8 with its own scale,
max |x| / 127, and the product is an exact integer sum scaled once:

    out[m, n] = (float)(sum_k xq[m, k] * q[n, k]) * (scale_x[m] * scale_w[n]) + bias[n]

Unlike W8A16 (qweights.py) this changes the activations' numerics (each row
element moves by up to half a step, 1/254 of the row's max), which is why
it is a scheme of its own that a user or a checkpoint asks for. What it buys
is integer throughput: on AVX-512 VNNI CPUs without AMX, vpdpbusd does 64
multiply-adds an instruction, a float32 FMA 16 (octavo/kernels/w8a8_linear.c).

Under tensor parallelism each rank of a row-parallel layer rounds its own
slice of a row, with that slice's max: a split model's results differ
slightly from the unsplit one's (its weights' integers do not: they use
the whole rows' max, onthefly.py).

On a CPU with a C compiler, out features a multiple of 16 and float32 or
bf16 rows, the native kernel runs; elsewhere (CUDA, no compiler, other
shapes or dtypes) ``w8a8_product`` does the same operations in torch, bit
for bit the kernel's result on CPU (tests/kernels/test_w8a8_linear.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from octavo.kernels import ops
from octavo.kernels.w8a8_linear import LANES, W8A8LinearKernel, pack_w8a8, unpack_w8a8, w8a8_linear_kernel

# Inputs per float32 product in the torch path: every partial sum of up to
# 1024 products of int8 values (|x| <= 127, |q| <= 128) stays below 2^24,
# so float32 (even with bf16/TF32 inputs: int8 values are exact in them)
# adds them exactly; the chunks' sums are added in int32.
_EXACT_K = 1024


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M]): each row rounded to
    the nearest of 255 steps of max|row| / 127 (ties to even); a zero row
    gets scale 1. Divisions are elementwise (never by a reciprocal), as the kernel's."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = amax / torch.full_like(amax, 127.0)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return torch.round(xf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def int_product(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """xq int8 [M, K] @ q int8 [N, K]^T, exact, as int32 [M, N]."""
    acc = torch.zeros(xq.shape[0], q.shape[0], dtype=torch.int32, device=xq.device)
    for k0 in range(0, xq.shape[1], _EXACT_K):
        part = xq[:, k0:k0 + _EXACT_K].float() @ q[:, k0:k0 + _EXACT_K].float().T
        acc += part.to(torch.int32)
    return acc


def w8a8_product(rows: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The W8A8 product in torch: rows [M, K] (any float dtype), q int8
    [N, K], scales float32 [N], bias [N] or None -> [M, N] in the rows' dtype."""
    xq, sx = quantize_rows(rows)
    out = int_product(xq, q).float() * (sx[:, None] * scales[None, :])
    if bias is not None:
        out = out + bias.to(rows.dtype).float()
    return out.to(rows.dtype)


class W8A8Weight:
    """An int8 weight [N, K] with per-output scales [N], multiplied by rows
    rounded to int8 per row; call it like ``F.linear(x, weight, bias)``."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q must be int8 [N, K]; got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if scale.numel() != n:
            raise ValueError(f"scale must hold one value per output channel ({n}); got {tuple(scale.shape)}")
        self.out_features, self.in_features = n, k
        self.scales = scale.reshape(n).float().contiguous()
        kernel = w8a8_linear_kernel() if q.is_cpu else None
        self.kernel: Optional[W8A8LinearKernel] = kernel if kernel is not None and n % LANES == 0 else None
        if self.kernel is not None:
            self.packed, self.wsum = pack_w8a8(q)
        else:
            self.packed, self.wsum = q.contiguous(), None

    @property
    def nbytes(self) -> int:
        tensors = [self.packed, self.scales] + ([] if self.wsum is None else [self.wsum])
        return sum(t.numel() * t.element_size() for t in tensors)

    def kernel_name(self) -> str:
        return f"w8a8 {self.kernel.isa}" if self.kernel is not None else "w8a8 torch (exact integer product)"

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scales float32 [N]) in canonical order."""
        q = self.packed if self.kernel is None else unpack_w8a8(self.packed, self.in_features)
        return q, self.scales

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (what the rows, once rounded, are multiplied by)."""
        q, scales = self.unpack()
        return q.float() * scales[:, None]

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input must be [..., {self.in_features}]; got {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features)
        if self.kernel is None or not W8A8LinearKernel.supports(x.dtype) or not x.is_cpu:
            out = w8a8_product(rows, self.unpack()[0], self.scales, bias)
        else:
            if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
                bias = bias.to(x.dtype).contiguous()
            out = ops.call(self.kernel, torch.ops.octavo.w8a8_linear, rows.contiguous(), self.packed, self.wsum,
                           self.scales, bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)
