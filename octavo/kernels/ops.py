"""The native linear kernels (bf16 and int8/int4) as torch operators (``torch.ops.octavo.*``), so
that ``torch.compile`` (and later CUDA graphs) can trace through them: each
op has a schema, a CPU implementation calling the C kernel, and a fake
(meta) implementation giving the output's shape and dtype without running it.

Ops are device-agnostic by schema: another backend registers its own
implementation on the same op (``torch.library.impl("octavo::bf16_linear",
"cuda")(fn)``) and the callers do not change.

Eager calls skip the dispatcher (``call``): it costs ~8 us a call here,
measured, about 2% of a batch-1 decode step of a 100M model with ~50
products per token, for nothing an eager caller needs. Under
``torch.compile`` the op itself is what gets traced.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from octavo.kernels.amx_linear import amx_linear_kernel, amx_multiply
from octavo.kernels.bf16_linear import bf16_gemm_kernel, bf16_linear_kernel
from octavo.kernels.quant_linear import quant_linear_kernel

_LIB = torch.library.Library("octavo", "DEF")
_LIB.define("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define("amx_linear(Tensor x, Tensor blocks, Tensor? bias, int out_features) -> Tensor")
_LIB.define("bf16_gemm(Tensor x, Tensor weight, Tensor? bias, bool dot) -> Tensor")
_LIB.define("quant_linear(Tensor rows, int bits, int group_size, Tensor packed, Tensor scales, Tensor? mins, "
            "Tensor? bias, int out_features, bool amx) -> Tensor")


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear`` on a plain bf16 weight by bf16_linear.c, built for the process's CPU target."""
    return bf16_linear_kernel(required=True)(x, weight, bias)


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dot: bool) -> torch.Tensor:
    """``F.linear`` on a plain bf16 weight by the many-row GEMM (bf16_gemm.c):
    float32 products, or with ``dot`` AVX-512 BF16 dot products."""
    kernel = bf16_gemm_kernel(required=True, dot=dot)
    if kernel is None:
        raise ValueError("dot: this CPU target has no AVX-512 BF16 dot products")
    return kernel(x, weight, bias)


def amx_linear(x: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``F.linear`` on a weight in oneDNN's AMX blocked layout (amx_linear.py) by amx_linear.c."""
    return amx_multiply(amx_linear_kernel(required=True).lib, x, blocks, bias, out_features)


def quant_linear(rows: torch.Tensor, bits: int, group_size: int, packed: torch.Tensor, scales: torch.Tensor,
                 mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int,
                 amx: bool) -> torch.Tensor:
    """rows [M, K] @ an int8/int4 weight packed by octavo/kernels/quant_linear.py, by quant_linear.c."""
    return quant_linear_kernel(required=True)(rows, bits, group_size, packed, scales, mins, bias, out_features, amx)


_LIB.impl("bf16_linear", bf16_linear, "CPU")
_LIB.impl("amx_linear", amx_linear, "CPU")
_LIB.impl("bf16_gemm", bf16_gemm, "CPU")
_LIB.impl("quant_linear", quant_linear, "CPU")


@torch.library.register_fake("octavo::bf16_linear")
def _bf16_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("octavo::bf16_gemm")
def _bf16_gemm_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dot: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("octavo::amx_linear")
def _amx_linear_fake(x: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                     out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("octavo::quant_linear")
def _quant_linear_fake(rows: torch.Tensor, bits: int, group_size: int, packed: torch.Tensor, scales: torch.Tensor,
                       mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int,
                       amx: bool) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], out_features))


def call(direct: Callable[..., torch.Tensor], op: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``op(*args)`` while torch.compile traces, else the same kernel directly."""
    return op(*args) if torch.compiler.is_compiling() else direct(*args)
