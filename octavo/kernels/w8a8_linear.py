"""Python side of the int8-weight x int8-activation kernel (w8a8_linear.c):
the weight layout it reads and the call. The scheme (what the integers and
scales mean, the torch path elsewhere) is octavo/quant/w8a8.py's."""
from __future__ import annotations

import ctypes
from functools import cache
from typing import Optional

import torch
from torch.nn import functional as F

from octavo.kernels.build import kernel_library
from octavo.kernels.cpu_features import CpuTarget, cpu_target
from octavo.kernels.launch import launch

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
LANES = 16  # outputs per packed block: N must be a multiple
QUAD = 4  # consecutive k per 32-bit lane


def pack_w8a8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] -> (int8 [N/16][Kp/4][16][4], int32 [N] sums of each row):
    4 consecutive k of one output side by side, 16 outputs a 64-byte vector;
    K padded with zeros to Kp, a multiple of 4."""
    n, k = q.shape
    padded = F.pad(q, (0, -k % QUAD))
    packed = padded.view(n // LANES, LANES, -1, QUAD).transpose(1, 2).contiguous()
    return packed, q.sum(dim=1, dtype=torch.int32)


def unpack_w8a8(packed: torch.Tensor, k: int) -> torch.Tensor:
    blocks, quads, _, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * LANES, quads * QUAD)[:, :k]


class W8A8LinearKernel:
    """w8a8_linear.c built for one CPU target; ``isa`` names the path it
    runs: avx512_vnni (vpdpbusd), avx512 or avx2 (vpmaddwd on widened
    weights) or portable."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.octavo_w8a8_linear.argtypes = [_P, _C, _I, _I, _I, _P, _P, _P, _P, _P]
        lib.octavo_w8a8_linear.restype = _C
        lib.octavo_w8a8_isa.restype = ctypes.c_char_p
        self._lib = lib
        self.isa: str = lib.octavo_w8a8_isa().decode()

    @staticmethod
    def supports(x_dtype: torch.dtype) -> bool:
        return x_dtype in _DTYPES

    def __call__(self, rows: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
        """rows [M, K] contiguous (float32 or bf16), each rounded to int8 with
        its own scale, times the packed weight^T (scales float32 [N]; bias
        of the rows' dtype) -> [M, out_features] in the rows' dtype."""
        m, k = rows.shape
        out = torch.empty(m, out_features, dtype=rows.dtype)
        if m == 0:
            return out
        if launch(self._lib.octavo_w8a8_linear, rows.data_ptr(), _DTYPES[rows.dtype], m, k, out_features,
                  packed.data_ptr(), wsum.data_ptr(), scales.data_ptr(), None if bias is None else bias.data_ptr(),
                  out.data_ptr()):
            raise MemoryError("w8a8 linear kernel could not allocate its row buffers")
        return out


@cache
def _kernel(target: CpuTarget, required: bool) -> Optional[W8A8LinearKernel]:
    lib = kernel_library("w8a8_linear", target, required=required)
    return None if lib is None else W8A8LinearKernel(lib)


def w8a8_linear_kernel(target: Optional[CpuTarget] = None, required: bool = False) -> Optional[W8A8LinearKernel]:
    """The kernel for ``target`` (default: the process's), built on first
    use; None where it cannot be built (no C compiler), unless ``required``
    (then KernelBuildError)."""
    return _kernel(target or cpu_target(), required)
