"""Python side of the int8/int4 weight kernels (quant_linear.c): the layouts
they read and the calls. What the integers mean (scales, zero points,
groups) is octavo/quant/qweights.py's business."""
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
LANES = 16  # outputs per SIMD vector: N must be a multiple


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N/16][K][16]: 16 outputs of one k side by side."""
    n, k = q.shape
    return q.view(n // LANES, LANES, k).transpose(1, 2).contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * LANES, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (K even) -> uint8 [N/16][K/2][16], each byte
    q[n, k] | q[n, k + 1] << 4."""
    n, k = q.shape
    pairs = q.view(n // LANES, LANES, k // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    blocks, half, _ = packed.shape
    rows = packed.transpose(1, 2)  # [N/16][16][K/2]
    return torch.stack([rows & 15, rows >> 4], dim=-1).reshape(blocks * LANES, half * 2)


def pack_groups(values: torch.Tensor) -> torch.Tensor:
    """float [N, G] per-group values -> float32 [N/16][G][16]."""
    n, g = values.shape
    return values.float().view(n // LANES, LANES, g).transpose(1, 2).contiguous()


def unpack_groups(packed: torch.Tensor) -> torch.Tensor:
    blocks, g, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * LANES, g)


class QuantLinearKernel:
    """The kernels of quant_linear.c built for one CPU target: ``fma`` (any
    rows, float32 or bf16, exact float32 sums; ``isa`` names the instruction
    set it runs: avx512_bf16, avx512, avx2 or portable) and, where the target
    and the OS offer AMX, ``amx`` (bf16, many rows)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.octavo_qlinear_fma.argtypes = [_P, _C, _I, _I, _I, _P, _C, _I, _P, _P, _P, _P]
        lib.octavo_qlinear_fma.restype = _C
        lib.octavo_qlinear_amx.argtypes = [_P, _I, _I, _I, _P, _C, _I, _P, _P, _P, _P]
        lib.octavo_qlinear_amx.restype = _C
        lib.octavo_qlinear_amx_experts.argtypes = [_P, _I, _I, _I, _P, _P, _C, _I, _P, _P, _P]
        lib.octavo_qlinear_amx_experts.restype = _C
        lib.octavo_qlinear_isa.restype = ctypes.c_char_p
        self._lib = lib
        self.isa: str = lib.octavo_qlinear_isa().decode()
        self.has_amx = bool(lib.octavo_qlinear_amx_available())

    @staticmethod
    def supports(x_dtype: torch.dtype) -> bool:
        return x_dtype in _DTYPES

    def __call__(self, rows: torch.Tensor, bits: int, group: int, packed: torch.Tensor, scales: torch.Tensor,
                 mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int,
                 amx: bool) -> torch.Tensor:
        """rows [M, K] contiguous (float32 or bf16) @ the packed weight^T
        (+ bias, same dtype as rows) -> [M, out_features]. ``amx``: the tile
        path (bf16 rows, K a multiple of 32, out_features of 32)."""
        m, k = rows.shape
        out = torch.empty(m, out_features, dtype=rows.dtype)
        if m == 0:
            return out
        mins_ptr = None if mins is None else mins.data_ptr()
        bias_ptr = None if bias is None else bias.data_ptr()
        if amx:
            failed = launch(self._lib.octavo_qlinear_amx, rows.data_ptr(), m, k, out_features, packed.data_ptr(), bits,
                                                  group, scales.data_ptr(), mins_ptr, bias_ptr, out.data_ptr())
        else:
            failed = launch(self._lib.octavo_qlinear_fma, rows.data_ptr(), _DTYPES[rows.dtype], m, k, out_features,
                                                  packed.data_ptr(), bits, group, scales.data_ptr(), mins_ptr,
                                                  bias_ptr, out.data_ptr())
        if failed:
            raise MemoryError("quantized linear kernel could not allocate its row buffers")
        return out


    def amx_experts(self, rows: torch.Tensor, experts: torch.Tensor, bits: int, group: int, packed: torch.Tensor,
                    scales: torch.Tensor, mins: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
        """Row m of ``rows`` [M, K] (bf16, K a multiple of 32) times the dequantized weight of expert
        ``experts[m]`` (int64 [M], rows of one expert next to each other) on AMX tiles -> [M, out_features]
        (a multiple of 32). ``packed``, ``scales``, ``mins``: int64 tables [experts] of the addresses of
        each expert's packed weight and its factors (``mins`` None: no expert has them); the tensors behind
        them must outlive the call. Only where ``has_amx``."""
        m, k = rows.shape
        if rows.dtype != torch.bfloat16 or k % 32 or out_features % 32:
            raise ValueError(f"rows must be bfloat16 [M, K] with K and out_features multiples of 32; got "
                             f"{rows.dtype} {tuple(rows.shape)}, out_features {out_features}")
        if tuple(experts.shape) != (m,) or experts.dtype != torch.int64:
            raise ValueError(f"experts must be int64 [{m}]; got {experts.dtype} {tuple(experts.shape)}")
        rows, experts = rows.contiguous(), experts.contiguous()
        out = torch.empty(m, out_features, dtype=rows.dtype)
        if m and launch(self._lib.octavo_qlinear_amx_experts, rows.data_ptr(), m, k, out_features, experts.data_ptr(),
                        packed.data_ptr(), bits, group, scales.data_ptr(), None if mins is None else mins.data_ptr(),
                        out.data_ptr()):
            raise MemoryError("quantized AMX experts kernel could not allocate its buffers")
        return out


@cache
def _kernel(target: CpuTarget, required: bool) -> Optional[QuantLinearKernel]:
    lib = kernel_library("quant_linear", target, required=required)
    return None if lib is None else QuantLinearKernel(lib)


def quant_linear_kernel(target: Optional[CpuTarget] = None, required: bool = False) -> Optional[QuantLinearKernel]:
    """The kernel for ``target`` (default: the process's), built on first
    use; None where it cannot be built (no C compiler), unless ``required``
    (then KernelBuildError)."""
    return _kernel(target or cpu_target(), required)
