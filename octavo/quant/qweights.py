"""Quantized linear weights as the kernels read them, built from canonical
integer tensors: the one entry point for every quantized format.

A format's loader (on-the-fly quantization here; GPTQ, AWQ and
compressed-tensors checkpoints) only unpacks its own layout into the
canonical form below and calls ``Int8Weight`` / ``Int4Weight``; the result
multiplies like ``F.linear`` and is installed on a layer with
``QuantizedLinearMethod.install``.

Canonical form, one weight [N outputs, K inputs] of this rank's shard:

- ``Int8Weight(q, scale, zero=None)``: ``q`` int8 [N, K];
  ``scale`` float [N] (per output channel) or [N, K/g] (groups of g
  consecutive inputs); ``zero`` None (symmetric) or float zero points in
  q's units, shaped like ``scale``. w = (q - zero) * scale. (An unsigned
  8-bit format stores q - 128 with zero - 128.)
- ``Int4Weight(q, scales, zeros, group_size, perm=None)``: ``q`` uint8
  values 0..15 [N, K]; ``scales`` and ``zeros`` [N, K/g] (zeros as floats or
  integers, in q's units: w = (q - zero) * scale; symmetric formats pass 8);
  ``perm`` (act-order) a LongTensor [K]: weight column j multiplies input
  ``perm[j]`` (sort the columns by group, ``perm = argsort(g_idx)``, so the
  groups are contiguous).

The kernels compute q * scale + min with min = -zero * scale in float32, so
``dequantize()`` returns exactly that. At few rows (decode) the rows are by
default rounded to int8 per block of 32 as llama.cpp's Q8_0 rounds them and
multiplied by integer dot products (octavo/kernels/qdot_linear.c), changing
the numerics as llama.cpp's defaults do; ``quantized_activations("float")``
around the weights' construction keeps the rows in float. On a CPU the native kernels run
(octavo/kernels/quant_linear.c, built for the process's CPU target: AVX-512,
AVX2 or portable C, plus AMX tiles for many bf16 rows where the CPU has
them); elsewhere (CUDA, no C compiler, a dtype they do not take, out
features not a multiple of 16) the weight is dequantized per call and
F.linear runs: correct, not fast.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

import torch
from torch.nn import functional as F

from octavo.kernels import ops
from octavo.config import QUANTIZED_ACTIVATIONS
from octavo.kernels.bf16_linear import bf16_gemm_kernel
from octavo.kernels.qdot_linear import ROW_BLOCK, QdotLinearKernel, qdot_linear_kernel
from octavo.quant.linear_table import shared_table
from octavo.kernels.quant_linear import (
    LANES,
    QuantLinearKernel,
    pack_groups,
    pack_int4,
    pack_int8,
    quant_linear_kernel,
    unpack_groups,
    unpack_int4,
    unpack_int8,
)

# Rows up to which the exact FMA kernel runs where the CPU has AMX; more bf16
# rows go to the AMX tile kernel (dequantizing a 32-output group into L2 at a
# time), whose cost is shared by the rows (benchmarks/quantization.py
# --kernels).
FMA_ROWS = 4
# Without AMX the FMA kernel takes up to this many rows (decode: it reads the
# weight once at the read rate); beyond, a measured table (octavo/quant/linear_table.py's,
# ``MANY_ROW_BUCKETS``) picks between it and dequantizing the weight for a
# float product (Octavo's bf16 GEMM for bf16 rows): the FMA kernel widens every
# weight again for every 16-64 rows, which at prefill sizes costs more than
# one dequantization (forced avx512_bf16, llama-100m int8, 1024 rows: 2490 ms
# vs 2256 ms with oneDNN's product, one thread).
FMA_ALWAYS_ROWS = 64
MANY_ROW_BUCKETS = (256, 1024)
# Rows up to which, with int8 activations, the rows are rounded to int8 and
# multiplied by integer dot products (qdot_linear.c) rather than by the FMA
# kernel. At 4 rows it is still 1.2x (int8) and 1.3x (int4) the FMA kernel
# on SmolLM2-135M's layer (one thread, benchmarks/quantization.py --kernels);
# past it bf16 rows go to AMX tiles where the CPU has them (FMA_ROWS), and
# the FMA kernel shares each widened weight among more rows.
QDOT_ROWS = 4

_ACTIVATIONS: ContextVar[str] = ContextVar("quantized_activations", default="int8")


@contextmanager
def quantized_activations(mode: str) -> Iterator[None]:
    """Weights built inside take ``mode``'s rows at few rows: ``int8`` (rounded per block of 32 as
    llama.cpp's Q8_0, integer dot products; the default) or ``float`` (the rows as they are)."""
    if mode not in QUANTIZED_ACTIVATIONS:
        raise ValueError(f"quantized_activations must be one of {', '.join(QUANTIZED_ACTIVATIONS)}; got {mode!r}")
    token = _ACTIVATIONS.set(mode)
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


class QuantizedWeight:
    """A packed int8/int4 weight; call it like ``F.linear(x, weight, bias)``."""

    def __init__(self, q: torch.Tensor, bits: int, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 group_size: int, perm: Optional[torch.Tensor], mins: Optional[torch.Tensor] = None) -> None:
        """``zeros`` (w = (q - zero) * scale) or ``mins`` (w = q * scale + min), or neither (symmetric)."""
        n, k = q.shape
        if scales.dim() != 2 or scales.shape[0] != n or k % scales.shape[1] or k // scales.shape[1] != group_size:
            raise ValueError(f"scales must be [{n}, {k} / group_size {group_size}]; got {tuple(scales.shape)}")
        for name, t in (("zeros", zeros), ("mins", mins)):
            if t is not None and t.shape != scales.shape:
                raise ValueError(f"{name} must be shaped like scales {tuple(scales.shape)}; got {tuple(t.shape)}")
        if zeros is not None and mins is not None:
            raise ValueError("give zeros or mins, not both")
        if perm is not None and tuple(perm.shape) != (k,):
            raise ValueError(f"perm must be [{k}]; got {tuple(perm.shape)}")
        self.bits, self.out_features, self.in_features, self.group_size = bits, n, k, group_size
        self.perm = perm
        scales = scales.float()
        if mins is not None:
            mins = mins.float()
        elif zeros is not None:
            mins = -zeros.float() * scales
        kernel = quant_linear_kernel() if q.is_cpu else None
        native = kernel is not None and n % LANES == 0 and group_size % 4 == 0
        self.kernel: Optional[QuantLinearKernel] = kernel if native else None
        if self.kernel is not None:
            self.packed = pack_int8(q) if bits == 8 else pack_int4(q)
            self.scales, self.mins = pack_groups(scales), None if mins is None else pack_groups(mins)
            self.amx = self.kernel.has_amx and k % 32 == 0 and n % 32 == 0
            rounded = _ACTIVATIONS.get() == "int8" and k % ROW_BLOCK == 0 and group_size % ROW_BLOCK == 0
            self.qdot: Optional[QdotLinearKernel] = qdot_linear_kernel() if rounded else None
            self._many_rows: dict[torch.dtype, dict[int, str]] = {}  # rows dtype -> bucket -> way
        else:
            self.packed, self.scales, self.mins, self.amx, self.qdot = q.contiguous(), scales, mins, False, None

    @property
    def nbytes(self) -> int:
        tensors = [self.packed, self.scales] + [t for t in (self.mins, self.perm) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def kernel_name(self) -> str:
        if self.kernel is None:
            return f"int{self.bits} dequantize + F.linear"
        fma = f"int{self.bits} fma {self.kernel.isa}"
        name = f"{fma} (<= {FMA_ROWS} rows) + amx" if self.amx else \
            f"{fma} (> {FMA_ALWAYS_ROWS} rows: measured, fma or dequantize)"
        if self.qdot is not None:
            return f"int{self.bits} x q8_0 rows {self.qdot.isa} (<= {QDOT_ROWS} rows), else {name}"
        return name

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(q [N, K], scales [N, G] float32, mins [N, G] float32 or None): the
        integers and float32 factors the kernels read, back in canonical order."""
        if self.kernel is None:
            return self.packed, self.scales, self.mins
        q = unpack_int8(self.packed) if self.bits == 8 else unpack_int4(self.packed)
        return q, unpack_groups(self.scales), None if self.mins is None else unpack_groups(self.mins)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernels multiply by (columns in the
        order of the permuted inputs when ``perm`` is set)."""
        q, scales, mins = self.unpack()
        w = q.float() * scales.repeat_interleave(self.group_size, dim=1)
        if mins is not None:
            w += mins.repeat_interleave(self.group_size, dim=1)
        return w

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input must be [..., {self.in_features}]; got {tuple(x.shape)}")
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.kernel is None or not QuantLinearKernel.supports(x.dtype) or not x.is_cpu:
            return F.linear(x, self.dequantize().to(x.dtype), bias)
        rows = x.reshape(-1, self.in_features).contiguous()
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            bias = bias.to(x.dtype).contiguous()
        if self.qdot is not None and rows.shape[0] <= QDOT_ROWS:
            out = ops.call(self.qdot, torch.ops.octavo.qdot_linear, rows, self.bits, self.group_size, self.packed,
                           self.scales, self.mins, bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        amx = self.amx and x.dtype == torch.bfloat16 and rows.shape[0] > FMA_ROWS
        if not amx and rows.shape[0] > FMA_ALWAYS_ROWS and self._many_rows_way(rows.shape[0], x.dtype) == "dequantize":
            out = self._dequantized_product(rows, bias)
        else:
            out = self._kernel_product(rows, bias, amx)
        return out.view(*x.shape[:-1], self.out_features)

    def _kernel_product(self, rows: torch.Tensor, bias: Optional[torch.Tensor], amx: bool) -> torch.Tensor:
        return ops.call(self.kernel, torch.ops.octavo.quant_linear, rows, self.bits, self.group_size, self.packed,
                        self.scales, self.mins, bias, self.out_features, amx)

    def _dequantized_product(self, rows: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The product by the dequantized weight: Octavo's GEMM for bf16 rows, torch's for float32."""
        weight = self.dequantize().to(rows.dtype)
        if rows.dtype == torch.bfloat16 and bf16_gemm_kernel() is not None:
            return ops.call(ops.bf16_gemm, torch.ops.octavo.bf16_gemm, rows, weight, bias, False)
        return F.linear(rows, weight, bias)

    def _many_rows_way(self, rows: int, dtype: torch.dtype) -> str:
        """``fma`` or ``dequantize`` for a product of ``rows`` > FMA_ALWAYS_ROWS rows of ``dtype``, as the
        linear table measured for this weight's shape (on this weight, the first time on this CPU)."""
        ways = self._many_rows.get(dtype)
        if ways is None:
            def ways_at(count: int) -> dict[str, Callable[[], object]]:
                x = torch.randn(count, self.in_features).to(dtype)
                return {"fma": lambda: self._kernel_product(x, None, False),
                        "dequantize": lambda: self._dequantized_product(x, None)}

            key = (f"int{self.bits}g{self.group_size}{'z' if self.mins is not None else ''}:"
                   f"{self.out_features}x{self.in_features}:{str(dtype).removeprefix('torch.')}")
            ways = self._many_rows[dtype] = shared_table().choose(key, MANY_ROW_BUCKETS, ways_at)
        return ways[next((b for b in MANY_ROW_BUCKETS if rows <= b), MANY_ROW_BUCKETS[-1])]


class Int8Weight(QuantizedWeight):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor] = None) -> None:
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q must be int8 [N, K]; got {q.dtype} {tuple(q.shape)}")
        scales = scale.view(-1, 1) if scale.dim() == 1 else scale
        zeros = None if zero is None else (zero.view(-1, 1) if zero.dim() == 1 else zero)
        group = q.shape[1] // scales.shape[1] if scales.dim() == 2 and scales.shape[1] else 0
        super().__init__(q, 8, scales, zeros, group, None)


class Int4Weight(QuantizedWeight):
    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int,
                 perm: Optional[torch.Tensor] = None, mins: Optional[torch.Tensor] = None) -> None:
        if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2:
            raise ValueError(f"q must be uint8 [N, K] with K even; got {q.dtype} {tuple(q.shape)}")
        if int(q.max()) > 15:
            raise ValueError("q holds values above 15: int4 values are 0..15")
        super().__init__(q, 4, scales, zeros, group_size, perm, mins)
