"""Python side of Quest's native page choice (quest_pages.c): the key bounds folded in as keys are written, and
each decode row's pages chosen from them, one call each per layer (both recorded by kernel tapes)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from octavo.kernels.build import kernel_library
from octavo.kernels.launch import launch

_FLOAT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CACHE_CODES = {**_FLOAT_CODES, torch.int8: 3, torch.float8_e4m3fn: 4}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_FOLD_ARGTYPES = [_P, ctypes.c_int, _P, _P, ctypes.c_int, _P, _I, _I, _I, _I, _I]
_SELECT_ARGTYPES = [_P, _I, ctypes.c_int, _P, ctypes.c_int, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _P, _P]
_FAIL_MEMORY, _FAIL_SLOT = -1, -2


class QuestPagesKernel:
    """The bounds' upkeep and the page choice over a layer's cache, in place."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fold = lib.octavo_quest_fold_bounds
        self._select = lib.octavo_quest_select
        for fn, argtypes in ((self._fold, _FOLD_ARGTYPES), (self._select, _SELECT_ARGTYPES)):
            fn.argtypes, fn.restype = argtypes, ctypes.c_int

    @staticmethod
    def supports(device: torch.device, cache_dtype: torch.dtype) -> bool:
        return device.type == "cpu" and cache_dtype in _CACHE_CODES

    def fold_bounds(self, k_cache: torch.Tensor, k_scales: Optional[torch.Tensor], bounds: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """Fold the keys at ``slots`` [n] int64 of ``k_cache`` [blocks, block_size, kv_heads, D] (times
        ``k_scales`` [blocks, kv_heads, block_size] float32 for an int8 / float8_e4m3fn cache) into
        ``bounds`` [kv_heads, blocks, 2, D] (minimum, maximum): a slot at a block's start resets its block."""
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        if slots.dtype != torch.int64 or bounds.shape != (kv_heads, num_blocks, 2, head_dim):
            raise ValueError(f"slots must be int64 and bounds [{kv_heads}, {num_blocks}, 2, {head_dim}]; got "
                             f"{slots.dtype} and {tuple(bounds.shape)}")
        slots = slots.contiguous()
        status = launch(self._fold, k_cache.data_ptr(), _CACHE_CODES[k_cache.dtype],
                        None if k_scales is None else k_scales.data_ptr(), bounds.data_ptr(),
                        _FLOAT_CODES[bounds.dtype], slots.data_ptr(), slots.shape[0], num_blocks, block_size,
                        kv_heads, head_dim)
        if status == _FAIL_SLOT:
            raise ValueError(f"slots must lie in [0, {num_blocks * block_size})")

    def select(self, q: torch.Tensor, bounds: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
               block_size: int, top_pages: int, recent_pages: int, out_table: torch.Tensor,
               out_lens: torch.Tensor) -> None:
        """For rows q [rows, heads, D] (rows may lie apart: the engine's q is a view of its fused projection)
        with block tables ``tables`` [rows, width] int64 (a view of a wider table is read in place) and
        context lengths ``lens`` [rows] int64: each row's chosen pages into ``out_table`` [rows, top_pages +
        recent_pages] int64 and its cut length into ``out_lens`` [rows] int64 (a row of at most that many
        pages: its table and length unchanged)."""
        rows, heads, head_dim = q.shape
        kv_heads, num_blocks = bounds.shape[:2]
        if (out_table.shape != (rows, top_pages + recent_pages) or out_lens.shape != (rows,)
                or tables.shape[0] != rows or lens.shape != (rows,)):
            raise ValueError(f"{rows} rows need tables and lens of {rows} rows, out_table [{rows}, "
                             f"{top_pages + recent_pages}] and out_lens [{rows}]; got {tuple(tables.shape)}, "
                             f"{tuple(lens.shape)}, {tuple(out_table.shape)}, {tuple(out_lens.shape)}")
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        status = launch(self._select, q.data_ptr(), q.stride(0), _FLOAT_CODES[q.dtype], bounds.data_ptr(),
                        _FLOAT_CODES[bounds.dtype], num_blocks, tables.data_ptr(), tables.stride(0),
                        lens.contiguous().data_ptr(), rows, heads, kv_heads, head_dim, block_size, top_pages,
                        recent_pages, out_table.data_ptr(), out_lens.data_ptr())
        if status == _FAIL_MEMORY:
            raise MemoryError("the Quest page choice could not allocate its work buffers")


def quest_pages_kernel(required: bool = False) -> Optional[QuestPagesKernel]:
    """The kernel, built on first use; None when it cannot be built, unless ``required`` (then the build error
    is raised)."""
    lib = kernel_library("quest_pages", required=required)
    return None if lib is None else QuestPagesKernel(lib)
