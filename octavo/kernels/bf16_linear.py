"""Python side of the bf16 linear kernels on the plain [N, K] bf16 weight for
CPUs without AMX, ``y = x @ W^T + b``: the few-row one (bf16_linear.c, a
weight read) and the many-row GEMM (bf16_gemm.c: float32 products on every
target, vdpbf16ps ones too on AVX-512 BF16). They are built for every target
(the instruction set they run is the target's) and share one C signature, so
one wrapper serves all."""
from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Optional

import torch

from octavo.kernels.build import kernel_library
from octavo.kernels.cpu_features import BY_NAME, CpuTarget, cpu_target
from octavo.kernels.launch import launch

_P, _I = ctypes.c_void_p, ctypes.c_int64
# For a target whose few-row kernel multiplies by vdpbf16ps, the target whose build of the same source widens
# bf16 to float32 and uses FMAs instead. Which is faster depends on the CPU and the rows (an Emerald Rapids VM
# without AMX: widening 20% faster at four rows, from cache and from memory; at one row 5% slower from cache and
# 5% faster streaming; the AMX Xeon forced to avx512_bf16: even), so the linear table measures both.
_WIDENING = {"avx512_bf16": "avx512"}


class Bf16LinearKernel:
    """The C function ``octavo_<name>`` (bf16_linear, bf16_gemm or
    bf16_gemm_dot) of a kernel library built for one target; ``isa`` names
    the path the compiler took (avx512_bf16, avx512, avx2 or portable)."""

    def __init__(self, lib: ctypes.CDLL, name: str = "bf16_linear") -> None:
        self._fn = getattr(lib, f"octavo_{name}")
        self._fn.argtypes = [_P, _P, _P, _I, _I, _I, _P]
        self._fn.restype = ctypes.c_int
        self._experts = getattr(lib, "octavo_bf16_linear_experts", None) if name == "bf16_linear" else None
        if self._experts is not None:
            self._experts.argtypes = [_P, _P, _P, _I, _I, _I, _P]
            self._experts.restype = ctypes.c_int
        isa = getattr(lib, f"octavo_{name}_isa")
        isa.restype = ctypes.c_char_p
        self.name = name
        self.isa: str = isa().decode()
        # The build's cache folder, named by a hash of source, compiler, flags and CPU.
        self.build: str = Path(lib._name).parent.name

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.is_contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for CPU bf16 tensors, weight and bias contiguous."""
        n, k = weight.shape
        if x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[-1] != k:
            raise ValueError(f"input must be a CPU bfloat16 tensor [..., {k}]; got {x.dtype} {tuple(x.shape)} "
                             f"on {x.device}")
        if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (n,)
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous bfloat16 [{n}]; got {bias.dtype} {tuple(bias.shape)}")
        rows = x.reshape(-1, k).contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        if rows.shape[0] and n and launch(
            self._fn, rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), rows.shape[0], k, n,
            out.data_ptr(),
        ):
            raise MemoryError(f"{self.name} kernel could not allocate its buffers")
        return out.view(*x.shape[:-1], n)

    def experts(self, rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Row m of ``rows`` [M, K] times ``weights[experts[m]]``^T, ``weights`` every expert's bf16 weight
        stacked [E, N, K] (contiguous), ``experts`` int64 [M] with rows of one expert next to each other
        -> [M, N] bf16. The few-row kernel only (bf16_linear.c)."""
        if self._experts is None:
            raise ValueError(f"{self.name}: no experts entry (the few-row kernel, bf16_linear, has it)")
        m, k = rows.shape
        if (rows.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16 or weights.dim() != 3
                or weights.shape[2] != k or not weights.is_contiguous()):
            raise ValueError(f"rows must be bfloat16 [M, K] and weights contiguous bfloat16 [E, N, {k}]; got "
                             f"{rows.dtype} {tuple(rows.shape)} and {weights.dtype} {tuple(weights.shape)}")
        if tuple(experts.shape) != (m,) or experts.dtype != torch.int64:
            raise ValueError(f"experts must be int64 [{m}]; got {experts.dtype} {tuple(experts.shape)}")
        rows, experts = rows.contiguous(), experts.contiguous()
        out = torch.empty(m, weights.shape[1], dtype=torch.bfloat16)
        if m and launch(self._experts, rows.data_ptr(), weights.data_ptr(), experts.data_ptr(), m, k,
                        weights.shape[1], out.data_ptr()):
            raise MemoryError("bf16 experts kernel could not allocate its buffers")
        return out


@cache
def _kernel(source: str, name: str, target: CpuTarget, required: bool) -> Optional[Bf16LinearKernel]:
    lib = kernel_library(source, target, required=required)
    if lib is None or not hasattr(lib, f"octavo_{name}"):  # a function only some targets' builds have
        return None
    return Bf16LinearKernel(lib, name)


def bf16_linear_kernel(target: Optional[CpuTarget] = None, required: bool = False) -> Optional[Bf16LinearKernel]:
    """The few-row kernel for ``target`` (default: the process's), built on
    first use; None where it cannot be built, unless ``required`` (then KernelBuildError)."""
    return _kernel("bf16_linear", "bf16_linear", target or cpu_target(), required)


def bf16_linear_widening_kernel(target: Optional[CpuTarget] = None) -> Optional[Bf16LinearKernel]:
    """On a target whose few-row kernel uses AVX-512 BF16 dot products, the same kernel built to widen bf16 to
    float32 and multiply by FMAs (it runs on the same CPU); None on other targets or where it cannot be built."""
    widening = _WIDENING.get((target or cpu_target()).name)
    return None if widening is None else _kernel("bf16_linear", "bf16_linear", BY_NAME[widening], False)


def bf16_gemm_kernel(target: Optional[CpuTarget] = None, required: bool = False,
                     dot: bool = False) -> Optional[Bf16LinearKernel]:
    """The many-row GEMM (bf16_gemm.c) for ``target``, as ``bf16_linear_kernel``:
    float32 products, or with ``dot`` vdpbf16ps ones (None where the target
    has no AVX-512 BF16, even when ``required``)."""
    return _kernel("bf16_gemm", "bf16_gemm_dot" if dot else "bf16_gemm", target or cpu_target(), required)
