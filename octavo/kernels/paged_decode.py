"""Python side of the native paged decode-attention kernel (paged_decode.c)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from octavo.kernels.build import kernel_library
from octavo.kernels.launch import launch

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The cache may also be quantized (int8 / float8_e4m3fn values with float32 scales).
_QUANT_CODES = {torch.int8: 3, torch.float8_e4m3fn: 4}
_CACHE_CODES = {**_DTYPE_CODES, **_QUANT_CODES}
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,  # q, q's sequence stride, out, q dtype
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # k cache, v cache, cache dtype
    ctypes.c_void_p, ctypes.c_void_p,  # k scales, v scales (quantized caches; else NULL)
    ctypes.c_void_p, ctypes.c_int64,  # block tables, their row stride
    ctypes.c_void_p, ctypes.c_int64,  # context lens, num seqs
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # heads, kv heads, head dim
    ctypes.c_int64, ctypes.c_int64, ctypes.c_float,  # block size, window, scale
    ctypes.c_float,  # soft cap (0: none)
]
_FAIL_MEMORY, _FAIL_EMPTY_CONTEXT = -1, -2


class PagedDecodeKernel:
    """Decode attention over the block tables, reading K/V in place."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.octavo_paged_decode
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype in _DTYPE_CODES and cache_dtype in _CACHE_CODES

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        window: Optional[int],
        scale: float,
        k_scales: Optional[torch.Tensor] = None,
        v_scales: Optional[torch.Tensor] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """q [seqs, heads, D]; k/v_cache [blocks, block_size, kv_heads, D];
        block_tables [seqs, width] int64 (rows may be a view of a wider table); context_lens [seqs] int64 (each
        query attends to positions 0 .. len-1, or the last ``window`` of them).
        An int8 / float8_e4m3fn cache needs its k/v_scales [blocks, kv_heads,
        block_size] float32 (value = stored * scale). ``softcap``: scores
        (already times ``scale``) become softcap * tanh(score / softcap)
        before the softmax. Returns [seqs, heads, D] in q's dtype, contiguous.
        q may be a view with gaps between its sequences (the engine's q is
        part of the fused QKV projection's output): read in place."""
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
        if cache_head_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(f"q {tuple(q.shape)} does not fit a cache of shape {tuple(k_cache.shape)}")
        if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64:
            raise ValueError("block_tables and context_lens must be int64")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the K/V cache views must be contiguous")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
        quantized = k_cache.dtype in _QUANT_CODES
        if quantized:
            want = (k_cache.shape[0], num_kv_heads, block_size)
            for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
                if t is None or t.dtype != torch.float32 or tuple(t.shape) != want or not t.is_contiguous():
                    raise ValueError(f"a {k_cache.dtype} cache needs contiguous float32 {name} {want}")
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        context_lens = context_lens.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        status = launch(
            self._fn,
            q.data_ptr(), q.stride(0), out.data_ptr(), _DTYPE_CODES[q.dtype],
            k_cache.data_ptr(), v_cache.data_ptr(), _CACHE_CODES[k_cache.dtype],
            k_scales.data_ptr() if quantized else None, v_scales.data_ptr() if quantized else None,
            block_tables.data_ptr(), block_tables.stride(0),
            context_lens.data_ptr(), num_seqs,
            num_heads, num_kv_heads, head_dim,
            block_size, window or 0, scale, softcap or 0.0,
        )
        if status == _FAIL_EMPTY_CONTEXT:
            raise ValueError("every sequence's context length must be at least 1")
        if status != 0:
            raise MemoryError("paged decode kernel could not allocate its work buffers")
        return out


def paged_decode_kernel(required: bool = False) -> Optional[PagedDecodeKernel]:
    """The kernel, built on first use; None when it cannot be built, unless
    ``required`` (then the build error is raised)."""
    lib = kernel_library("paged_decode", required=required)
    return None if lib is None else PagedDecodeKernel(lib)
