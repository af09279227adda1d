"""Python side of the fused elementwise kernels (fused_ops.c): RMSNorm with the
residual add, SiLU-and-multiply, rotary embedding with the K/V cache write,
and the greedy argmax. Each gives the values the step-by-step torch ops give."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from octavo.kernels.build import kernel_library
from octavo.kernels.launch import launch

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Quantized K/V cache element types (cache only), as common.h numbers them.
_CACHE_CODES = {**_DTYPE_CODES, torch.int8: 3, torch.float8_e4m3fn: 4}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "octavo_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, ctypes.c_int], None),
    "octavo_silu_mul": ([_P, _P, _I, _I, ctypes.c_int], None),
    "octavo_rotary_write_kv": (
        [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, ctypes.c_int, ctypes.c_int, _P, _P, _P, _I], ctypes.c_int
    ),
    "octavo_argmax": ([_P, _I, _I, _P, ctypes.c_int], None),
}


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: Optional[tuple[int, ...]] = None) -> None:
    # Runs several times per layer and step: attribute reads only, no Device objects.
    if t.dtype != dtype or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor; got {t.dtype}, {tuple(t.shape)}, "
                         f"contiguous={t.is_contiguous()}, device {t.device}")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


class FusedOps:
    """The kernels of fused_ops.c for contiguous CPU tensors of one float dtype."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype in _DTYPE_CODES

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """RMSNorm over the last dim of ``x`` [rows, dim]. With ``residual``,
        normalises x + residual and leaves that sum in ``residual``."""
        dim = x.shape[-1]
        _check("x", x, x.dtype)
        _check("weight", weight, x.dtype, (dim,))
        if residual is not None:
            _check("residual", residual, x.dtype, tuple(x.shape))
        out = torch.empty_like(x)
        launch(
            self._lib.octavo_rms_norm, x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            x.numel() // max(dim, 1), dim, eps, _DTYPE_CODES[x.dtype],
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter]."""
        _check("gate_up", gate_up, gate_up.dtype)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be [rows, 2 * intermediate]; got {tuple(gate_up.shape)}")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, inter)
        launch(self._lib.octavo_silu_mul, gate_up.data_ptr(), out.data_ptr(), rows, inter, _DTYPE_CODES[gate_up.dtype])
        return out

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        scales: Optional[torch.Tensor] = None,
        static_scales: Optional[torch.Tensor] = None,
    ) -> None:
        """Rotate q and k of ``qkv`` [rows, (heads + 2 kv_heads) * head_dim] in
        place and write k, v to ``slots`` of the caches [..., kv_heads, head_dim].
        cos, sin [rows, head_dim]. Caches of int8 / float8_e4m3fn take the rows
        quantized, each row's scale into ``scales`` [2, num_blocks, kv_heads,
        block_size] float32 (K's, V's), or the fixed ``static_scales`` [2,
        kv_heads] when given (see octavo/attention/kv_quant.py)."""
        rows, width = qkv.shape
        head_dim = cos.shape[-1]
        if width != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv width {width} is not (heads {num_heads} + 2 x kv heads {num_kv_heads}) "
                             f"x head_dim {head_dim}")
        _check("qkv", qkv, qkv.dtype)
        for name, t in (("cos", cos), ("sin", sin)):
            _check(name, t, qkv.dtype, (rows, head_dim))
        quantized = k_cache.dtype in _CACHE_CODES and k_cache.dtype not in _DTYPE_CODES
        cache_dtype = k_cache.dtype if quantized else qkv.dtype
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            _check(name, t, cache_dtype)
            if tuple(t.shape[-2:]) != (num_kv_heads, head_dim):
                raise ValueError(f"{name} rows are {tuple(t.shape[-2:])}, expected {(num_kv_heads, head_dim)}")
        _check("slots", slots, torch.int64, (rows,))
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
        capacity = k_cache.numel() // (num_kv_heads * head_dim)
        block_size = 0
        if quantized:
            if scales is None or scales.dim() != 4 or scales.shape[:3] != (2, scales.shape[1], num_kv_heads):
                raise ValueError(f"a {k_cache.dtype} cache needs scales [2, blocks, kv_heads, block_size]")
            _check("scales", scales, torch.float32)
            block_size = scales.shape[-1]
            if scales.shape[1] * block_size != capacity:
                raise ValueError(f"scales {tuple(scales.shape)} do not cover the cache's {capacity} slots")
            if static_scales is not None:
                _check("static_scales", static_scales, torch.float32, (2, num_kv_heads))
        status = launch(
            self._lib.octavo_rotary_write_kv, qkv.data_ptr(), rows, num_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), capacity, _DTYPE_CODES[qkv.dtype],
            _CACHE_CODES[cache_dtype], scales[0].data_ptr() if quantized else None,
            scales[1].data_ptr() if quantized else None,
            None if static_scales is None or not quantized else static_scales.data_ptr(), block_size,
        )
        if status == -1:
            raise ValueError(f"rotary kernel takes an even head_dim up to 512; got {head_dim}")
        if status == -2:
            raise ValueError(f"slots must lie in [0, {capacity})")

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] -> each row's first maximum index [rows] int64."""
        _check("logits", logits, logits.dtype)
        if logits.dim() != 2:
            raise ValueError(f"logits must be [rows, vocab]; got {tuple(logits.shape)}")
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        launch(self._lib.octavo_argmax, logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
                                _DTYPE_CODES[logits.dtype])
        return out


def fused_ops(required: bool = False) -> Optional[FusedOps]:
    """The kernels, built on first use; None when they cannot be built, unless
    ``required`` (then the build error is raised)."""
    lib = kernel_library("fused_ops", required=required)
    return None if lib is None else FusedOps(lib)
