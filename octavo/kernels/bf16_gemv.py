"""Python side of the native few-row bf16 matmul (bf16_gemv.c)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from octavo.kernels.build import load_kernel, try_load_kernel


class Bf16Gemv:
    """y = x W^T + b for bf16 x with at most ``max_rows`` rows and bf16 W."""

    max_rows = 4  # MAX_ROWS in bf16_gemv.c

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.octavo_bf16_gemv
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        self._fn.restype = ctypes.c_int

    def accepts(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and 0 < x.shape[0] <= self.max_rows
            and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and weight.is_contiguous()
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.accepts(x, weight) or x.shape[1] != weight.shape[1]:
            raise ValueError(f"bf16 gemv cannot take x {tuple(x.shape)} {x.dtype} and W {tuple(weight.shape)}")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != weight.shape[:1]):
            raise ValueError(f"bias must be bf16 of shape {tuple(weight.shape[:1])}")
        x = x.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=torch.bfloat16)
        bias_ptr = None if bias is None else bias.contiguous().data_ptr()
        if self._fn(x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), m, n, k) != 0:
            raise RuntimeError("bf16 gemv kernel refused its inputs")
        return y


def bf16_gemv_kernel(required: bool = False) -> Optional[Bf16Gemv]:
    """The kernel, or None when it cannot be built or this CPU lacks AVX512-BF16
    (then ``required`` raises instead)."""
    lib = load_kernel("bf16_gemv") if required else try_load_kernel("bf16_gemv")
    if lib is not None and lib.octavo_bf16_gemv_available():
        return Bf16Gemv(lib)
    if required:
        raise RuntimeError("the bf16 gemv kernel needs a CPU with AVX512-BF16")
    return None
