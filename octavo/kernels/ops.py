"""The native CPU kernels as torch operators (``torch.ops.octavo.*``): the
linear products (bf16, int8/int4, both per expert, int8 x int8 rows), the fused elementwise kernels (RMSNorm
with the residual add, SiLU-and-multiply, rotary with the K/V cache write,
argmax) and paged decode attention. So ``torch.compile`` (and later CUDA
graphs) can trace through them: each op has a schema (the tensors a kernel
writes in place are marked mutable, so functionalization orders them), a CPU
implementation calling the C kernel, and a fake (meta) implementation giving
the output's shape and dtype without running it.

Ops are device-agnostic by schema: another backend registers its own
implementation on the same op (``torch.library.impl("octavo::bf16_linear",
"cuda")(fn)``) and the callers do not change.

Eager calls skip the dispatcher (``call``): it costs ~8 us a call here,
measured, about 2% of a batch-1 decode step of a 100M model with ~50
products per token, for nothing an eager caller needs. Under
``torch.compile`` the op itself is what gets traced.
"""
from __future__ import annotations

from functools import cache
from typing import Callable, Optional

import torch

from octavo.kernels.amx_linear import amx_linear_kernel, amx_multiply
from octavo.kernels.bf16_linear import bf16_gemm_kernel, bf16_linear_kernel, bf16_linear_widening_kernel
from octavo.kernels.fused_ops import FusedOps, fused_ops
from octavo.kernels.paged_decode import PagedDecodeKernel, paged_decode_kernel
from octavo.kernels.qdot_linear import qdot_linear_kernel
from octavo.kernels.quant_linear import quant_linear_kernel
from octavo.kernels.w8a8_linear import w8a8_linear_kernel

_LIB = torch.library.Library("octavo", "DEF")
_LIB.define("bf16_linear(Tensor x, Tensor weight, Tensor? bias, bool widen=False) -> Tensor")
_LIB.define("bf16_linear_experts(Tensor rows, Tensor weights, Tensor experts) -> Tensor")
_LIB.define("amx_linear(Tensor x, Tensor blocks, Tensor? bias, int out_features) -> Tensor")
_LIB.define("amx_linear_experts(Tensor rows, Tensor blocks, Tensor experts, int out_features) -> Tensor")
_LIB.define("bf16_gemm(Tensor x, Tensor weight, Tensor? bias, bool dot) -> Tensor")
_LIB.define("quant_linear(Tensor rows, int bits, int group_size, Tensor packed, Tensor scales, Tensor? mins, "
            "Tensor? bias, int out_features, bool amx) -> Tensor")
_LIB.define("quant_linear_experts(Tensor rows, Tensor experts, int bits, int group_size, Tensor packed, "
            "Tensor scales, Tensor? mins, int out_features) -> Tensor")
_LIB.define("qdot_linear(Tensor rows, int bits, int group_size, Tensor packed, Tensor scales, Tensor? mins, "
            "Tensor? bias, int out_features) -> Tensor")
_LIB.define("qdot_linear_experts(Tensor rows, Tensor experts, int bits, int group_size, Tensor packed, "
            "Tensor scales, Tensor? mins, int out_features) -> Tensor")
_LIB.define("w8a8_linear(Tensor rows, Tensor packed, Tensor wsum, Tensor scales, Tensor? bias, "
            "int out_features) -> Tensor")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual) -> Tensor")
_LIB.define("silu_mul(Tensor gate_up) -> Tensor")
_LIB.define("rotary_write_kv(Tensor(a!) qkv, int num_heads, int num_kv_heads, Tensor cos, Tensor sin, "
            "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor(d!)? scales, Tensor? static_scales) -> ()")
_LIB.define("argmax(Tensor logits) -> Tensor")
_LIB.define("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
            "int? window, float scale, Tensor? k_scales, Tensor? v_scales, float? softcap) -> Tensor")


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                widen: bool = False) -> torch.Tensor:
    """``F.linear`` on a plain bf16 weight by bf16_linear.c, built for the process's CPU target, or with
    ``widen`` for its float32-FMA sibling (``bf16_linear_widening_kernel``)."""
    if not widen:
        return bf16_linear_kernel(required=True)(x, weight, bias)
    kernel = bf16_linear_widening_kernel()
    if kernel is None:
        raise ValueError("widen: this CPU target's few-row kernel has no widening sibling")
    return kernel(x, weight, bias)


def bf16_linear_experts(rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Row m times ``weights[experts[m]]`` (every expert's bf16 weight stacked [E, N, K]) by bf16_linear.c: a
    mixture of experts' products at decode in one call."""
    return bf16_linear_kernel(required=True).experts(rows, weights, experts)


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


def amx_linear_experts(rows: torch.Tensor, blocks: torch.Tensor, experts: torch.Tensor,
                       out_features: int) -> torch.Tensor:
    """Row m times expert ``experts[m]``'s weight in the AMX blocked layout, found through the table of addresses
    ``blocks``, by amx_linear.c: a mixture of experts' products at a few row tiles per expert in one call."""
    return amx_linear_kernel(required=True).experts(rows, blocks, experts, out_features)


def quant_linear(rows: torch.Tensor, bits: int, group_size: int, packed: torch.Tensor, scales: torch.Tensor,
                 mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int,
                 amx: bool) -> torch.Tensor:
    """rows [M, K] @ an int8/int4 weight packed by octavo/kernels/quant_linear.py, by quant_linear.c."""
    return quant_linear_kernel(required=True)(rows, bits, group_size, packed, scales, mins, bias, out_features, amx)


def quant_linear_experts(rows: torch.Tensor, experts: torch.Tensor, bits: int, group_size: int, packed: torch.Tensor,
                         scales: torch.Tensor, mins: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """Row m (bf16) times expert ``experts[m]``'s int8/int4 weight, every expert's weight found through tables of
    addresses, dequantized a group at a time onto AMX tiles by quant_linear.c: a mixture of experts' products
    at many rows per expert in one call."""
    return quant_linear_kernel(required=True).amx_experts(rows, experts, bits, group_size, packed, scales, mins,
                                                          out_features)


def qdot_linear(rows: torch.Tensor, bits: int, group_size: int, packed: torch.Tensor, scales: torch.Tensor,
                mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """rows [M, K] rounded to int8 per block of 32 (llama.cpp's Q8_0) @ an int8/int4 weight packed by
    octavo/kernels/quant_linear.py, by integer dot products (qdot_linear.c)."""
    return qdot_linear_kernel(required=True)(rows, bits, group_size, packed, scales, mins, bias, out_features)


def qdot_linear_experts(rows: torch.Tensor, experts: torch.Tensor, bits: int, group_size: int, packed: torch.Tensor,
                        scales: torch.Tensor, mins: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """Row m times expert ``experts[m]``'s int8/int4 weight, every expert's weight found through tables of
    addresses (``packed``, ``scales``, ``mins``), by qdot_linear.c's integer dot products: a mixture of
    experts' products at decode in one call."""
    return qdot_linear_kernel(required=True).experts(rows, experts, bits, group_size, packed, scales, mins,
                                                     out_features)


def w8a8_linear(rows: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scales: torch.Tensor,
                bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """rows [M, K], rounded to int8 per row, @ a weight packed by w8a8_linear.py, by w8a8_linear.c."""
    return w8a8_linear_kernel(required=True)(rows, packed, wsum, scales, bias, out_features)


@cache
def _fused() -> FusedOps:
    return fused_ops(required=True)


@cache
def _paged_decode() -> PagedDecodeKernel:
    return paged_decode_kernel(required=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """FusedOps.rms_norm: with ``residual``, x + residual is left in it."""
    return _fused().rms_norm(x, weight, eps, residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _fused().silu_mul(gate_up)


def rotary_write_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, scales: Optional[torch.Tensor],
                    static_scales: Optional[torch.Tensor]) -> None:
    """FusedOps.rotary_write_kv: rotates q and k in ``qkv`` and writes k, v (and scales) into the caches."""
    _fused().rotary_write_kv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slots, scales, static_scales)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return _fused().argmax(logits)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, window: Optional[int], scale: float, k_scales: Optional[torch.Tensor],
                 v_scales: Optional[torch.Tensor], softcap: Optional[float]) -> torch.Tensor:
    """PagedDecodeKernel: decode attention reading K/V in place through the block tables."""
    return _paged_decode()(q, k_cache, v_cache, block_tables, context_lens, window, scale, k_scales, v_scales, softcap)


_LIB.impl("bf16_linear", bf16_linear, "CPU")
_LIB.impl("bf16_linear_experts", bf16_linear_experts, "CPU")
_LIB.impl("amx_linear", amx_linear, "CPU")
_LIB.impl("amx_linear_experts", amx_linear_experts, "CPU")
_LIB.impl("bf16_gemm", bf16_gemm, "CPU")
_LIB.impl("quant_linear", quant_linear, "CPU")
_LIB.impl("quant_linear_experts", quant_linear_experts, "CPU")
_LIB.impl("qdot_linear", qdot_linear, "CPU")
_LIB.impl("qdot_linear_experts", qdot_linear_experts, "CPU")
_LIB.impl("w8a8_linear", w8a8_linear, "CPU")
for _name, _fn in (("rms_norm", rms_norm), ("silu_mul", silu_mul), ("rotary_write_kv", rotary_write_kv),
                   ("argmax", argmax), ("paged_decode", paged_decode)):
    _LIB.impl(_name, _fn, "CPU")


@torch.library.register_fake("octavo::bf16_linear")
def _bf16_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      widen: bool = False) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("octavo::bf16_linear_experts")
def _bf16_linear_experts_fake(rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], weights.shape[1]))


@torch.library.register_fake("octavo::bf16_gemm")
def _bf16_gemm_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dot: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("octavo::amx_linear")
def _amx_linear_fake(x: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                     out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("octavo::amx_linear_experts")
def _amx_linear_experts_fake(rows: torch.Tensor, blocks: torch.Tensor, experts: torch.Tensor,
                             out_features: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], out_features))


@torch.library.register_fake("octavo::quant_linear")
def _quant_linear_fake(rows: torch.Tensor, bits: int, group_size: int, packed: torch.Tensor, scales: torch.Tensor,
                       mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int,
                       amx: bool) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], out_features))


@torch.library.register_fake("octavo::quant_linear_experts")
def _quant_linear_experts_fake(rows: torch.Tensor, experts: torch.Tensor, bits: int, group_size: int,
                               packed: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                               out_features: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], out_features))


@torch.library.register_fake("octavo::qdot_linear")
def _qdot_linear_fake(rows: torch.Tensor, bits: int, group_size: int, packed: torch.Tensor, scales: torch.Tensor,
                      mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], out_features))


@torch.library.register_fake("octavo::qdot_linear_experts")
def _qdot_linear_experts_fake(rows: torch.Tensor, experts: torch.Tensor, bits: int, group_size: int,
                              packed: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                              out_features: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], out_features))


@torch.library.register_fake("octavo::w8a8_linear")
def _w8a8_linear_fake(rows: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scales: torch.Tensor,
                      bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], out_features))


@torch.library.register_fake("octavo::rms_norm")
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("octavo::silu_mul")
def _silu_mul_fake(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.register_fake("octavo::rotary_write_kv")
def _rotary_write_kv_fake(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          scales: Optional[torch.Tensor], static_scales: Optional[torch.Tensor]) -> None:
    return None


@torch.library.register_fake("octavo::argmax")
def _argmax_fake(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.register_fake("octavo::paged_decode")
def _paged_decode_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, window: Optional[int], scale: float,
                       k_scales: Optional[torch.Tensor], v_scales: Optional[torch.Tensor],
                       softcap: Optional[float]) -> torch.Tensor:
    return q.new_empty(q.shape)


def call(direct: Callable[..., torch.Tensor], op: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``op(*args)`` while torch.compile traces, else the same kernel directly."""
    return op(*args) if torch.compiler.is_compiling() else direct(*args)
