"""Python side of the integer-dot-product kernel for int8/int4 weights at few
rows (qdot_linear.c): rows rounded to int8 per block of 32 as llama.cpp's
Q8_0 rounds them, times quant_linear.c's packed weights as they are."""
from __future__ import annotations

import ctypes
from functools import cache
from typing import Optional

import torch

from octavo.kernels.build import kernel_library
from octavo.kernels.cpu_features import CpuTarget, cpu_target
from octavo.kernels.launch import launch

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ROW_BLOCK = 32  # inputs per rounded block (Q8_0's): K and the weight's groups must be multiples


class QdotLinearKernel:
    """qdot_linear.c built for one CPU target; ``isa`` names the path it runs:
    avx512_vnni (vpdpbusd), avx2 (vpmaddubsw + vpmaddwd) or portable."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.octavo_qdot_linear.argtypes = [_P, _C, _I, _I, _I, _P, _C, _I, _P, _P, _P, _P]
        lib.octavo_qdot_linear.restype = _C
        lib.octavo_qdot_linear_experts.argtypes = [_P, _C, _I, _I, _I, _P, _P, _C, _I, _P, _P, _P]
        lib.octavo_qdot_linear_experts.restype = _C
        lib.octavo_qdot_isa.restype = ctypes.c_char_p
        self._lib = lib
        self.isa: str = lib.octavo_qdot_isa().decode()

    @staticmethod
    def supports(x_dtype: torch.dtype) -> bool:
        return x_dtype in _DTYPES

    def __call__(self, rows: torch.Tensor, bits: int, group: int, packed: torch.Tensor, scales: torch.Tensor,
                 mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
        """rows [M, K] contiguous (float32 or bf16), rounded to int8 per block
        of 32, times quant_linear's packed weight^T (+ bias, the rows' dtype)
        -> [M, out_features]. K and ``group`` multiples of 32."""
        m, k = rows.shape
        out = torch.empty(m, out_features, dtype=rows.dtype)
        if m == 0:
            return out
        if launch(self._lib.octavo_qdot_linear, rows.data_ptr(), _DTYPES[rows.dtype], m, k, out_features,
                  packed.data_ptr(), bits, group, scales.data_ptr(), None if mins is None else mins.data_ptr(),
                  None if bias is None else bias.data_ptr(), out.data_ptr()):
            raise MemoryError("qdot linear kernel could not allocate its row buffers")
        return out

    def experts(self, rows: torch.Tensor, experts: torch.Tensor, bits: int, group: int, packed: torch.Tensor,
                scales: torch.Tensor, mins: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
        """Row m [M, K] (float32 or bf16, contiguous) rounded as ``__call__`` rounds it, times the weight of
        expert ``experts[m]`` (int64 [M], rows of one expert next to each other) -> [M, out_features].
        ``packed``, ``scales``, ``mins``: int64 tables [experts] of the addresses of each expert's
        quant_linear-packed weight and its factors (``mins`` None: no expert has them); the tensors
        behind them must outlive the call."""
        m, k = rows.shape
        if tuple(experts.shape) != (m,) or experts.dtype != torch.int64:
            raise ValueError(f"experts must be int64 [{m}]; got {experts.dtype} {tuple(experts.shape)}")
        out = torch.empty(m, out_features, dtype=rows.dtype)
        if m == 0:
            return out
        experts = experts.contiguous()
        if launch(self._lib.octavo_qdot_linear_experts, rows.data_ptr(), _DTYPES[rows.dtype], m, k, out_features,
                  experts.data_ptr(), packed.data_ptr(), bits, group, scales.data_ptr(),
                  None if mins is None else mins.data_ptr(), out.data_ptr()):
            raise MemoryError("qdot experts kernel could not allocate its row buffers")
        return out


@cache
def _kernel(target: CpuTarget, required: bool) -> Optional[QdotLinearKernel]:
    lib = kernel_library("qdot_linear", target, required=required)
    return None if lib is None else QdotLinearKernel(lib)


def qdot_linear_kernel(target: Optional[CpuTarget] = None, required: bool = False) -> Optional[QdotLinearKernel]:
    """The kernel for ``target`` (default: the process's), built on first
    use; None where it cannot be built (no C compiler), unless ``required``
    (then KernelBuildError)."""
    return _kernel(target or cpu_target(), required)
