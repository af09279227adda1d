"""Python side of the few-row bf16 linear kernel (bf16_linear.c): ``y = x @
W^T + b`` on the plain [N, K] bf16 weight, for CPUs without AMX (it is built
for every target; the instruction set it runs is the target's)."""
from __future__ import annotations

import ctypes
from functools import cache
from typing import Optional

import torch

from octavo.kernels.build import load_kernel, try_load_kernel
from octavo.kernels.cpu_features import CpuTarget, cpu_target
from octavo.kernels.launch import launch

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Bf16LinearKernel:
    """The kernel of bf16_linear.c built for one target; ``isa`` names the
    path the compiler took (avx512_bf16, avx512, avx2 or portable)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.octavo_bf16_linear.argtypes = [_P, _P, _P, _I, _I, _I, _P]
        lib.octavo_bf16_linear.restype = ctypes.c_int
        lib.octavo_bf16_linear_isa.restype = ctypes.c_char_p
        self._lib = lib
        self.isa: str = lib.octavo_bf16_linear_isa().decode()

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
            self._lib.octavo_bf16_linear, rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), rows.shape[0], k, n,
            out.data_ptr(),
        ):
            raise MemoryError("bf16 linear kernel could not allocate its prepared rows")
        return out.view(*x.shape[:-1], n)


@cache
def _kernel(target: CpuTarget, required: bool) -> Optional[Bf16LinearKernel]:
    lib = load_kernel("bf16_linear", target) if required else try_load_kernel("bf16_linear", target)
    return None if lib is None else Bf16LinearKernel(lib)


def bf16_linear_kernel(target: Optional[CpuTarget] = None, required: bool = False) -> Optional[Bf16LinearKernel]:
    """The kernel for ``target`` (default: the process's), built on first
    use; None where it cannot be built, unless ``required`` (then KernelBuildError)."""
    return _kernel(target or cpu_target(), required)
