"""Python side of the AMX linear kernel (amx_linear.c): ``y = x @ W^T + b`` for
decode batches of bf16 rows (up to 64 in the layers), reading the weight in
oneDNN's prepacked layout: the copy the model already holds."""
from __future__ import annotations

import ctypes
from functools import cache
from typing import Optional

import torch
from torch.nn import functional as F

from octavo.kernels.build import kernel_library
from octavo.kernels.cpu_features import CpuTarget, cpu_target
from octavo.kernels.launch import launch

_P, _I = ctypes.c_void_p, ctypes.c_int64
# AB16b32a2b: groups of 32 outputs, blocks of 32 k's.
N_BLOCK, K_BLOCK = 32, 32


def blocked_layout(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32][K/32][16][32][2] (N zero-padded to a multiple of 32):
    the bytes the kernel reads. K must be a multiple of 32."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % N_BLOCK))
    return padded.view(-1, N_BLOCK, k // K_BLOCK, K_BLOCK // 2, 2).permute(0, 2, 3, 1, 4).contiguous()


def _onednn_bytes(packed: torch.Tensor, numel: int) -> Optional[torch.Tensor]:
    """A bf16 view (no copy) of an opaque oneDNN tensor's buffer, or None when
    its size is not ``numel`` elements. The view is valid while ``packed`` lives."""
    if torch.ops.mkldnn._nbytes(packed) != 2 * numel:
        return None
    buffer = (ctypes.c_uint16 * numel).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buffer, dtype=torch.bfloat16)


class AmxLinearKernel:
    """The kernel of amx_linear.c, on a CPU with AMX bf16 tiles."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.octavo_amx_linear.argtypes = [_P, _P, _P, _I, _I, _I, _P]
        lib.octavo_amx_linear.restype = ctypes.c_int
        lib.octavo_amx_linear_experts.argtypes = [_P, _P, _P, _I, _I, _I, _P]
        lib.octavo_amx_linear_experts.restype = ctypes.c_int
        lib.octavo_amx_streams.argtypes = [_I, _I]
        lib.octavo_amx_streams.restype = ctypes.c_int
        self.lib = lib

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether a weight [N, K] can be read by the kernel: CPU bf16, K a multiple of 32."""
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[1] % K_BLOCK == 0)

    def share_onednn(self, packed: torch.Tensor, weight: torch.Tensor) -> Optional[AmxWeight]:
        """The kernel reading oneDNN's prepacked copy ``packed`` of ``weight``
        in place, when its bytes are exactly the kernel's layout (oneDNN picks
        the layout per CPU and shape); else None. Keeps ``packed`` alive."""
        if not self.fits(weight):
            return None
        expected = blocked_layout(weight).view(-1)
        found = _onednn_bytes(packed, expected.numel())
        if found is None or not torch.equal(found.view(torch.int16), expected.view(torch.int16)):
            return None
        return AmxWeight(self.lib, found, *weight.shape, owner=packed)

    def experts(self, rows: torch.Tensor, blocks: torch.Tensor, experts: torch.Tensor,
                out_features: int) -> torch.Tensor:
        """Row m of ``rows`` [M, K] (CPU bf16, K a multiple of 32) times the weight [out_features, K] of expert
        ``experts[m]`` (int64 [M], rows of one expert next to each other) -> [M, out_features] bf16.
        ``blocks``: an int64 table [experts] of the addresses of each expert's weight in the blocked layout
        (``AmxWeight.blocks``); the tensors behind it must outlive the call."""
        m, k = rows.shape
        if rows.dtype != torch.bfloat16 or not rows.is_cpu or k % K_BLOCK:
            raise ValueError(f"rows must be a CPU bfloat16 tensor [M, K] with K a multiple of {K_BLOCK}; got "
                             f"{rows.dtype} {tuple(rows.shape)} on {rows.device}")
        if tuple(experts.shape) != (m,) or experts.dtype != torch.int64:
            raise ValueError(f"experts must be int64 [{m}]; got {experts.dtype} {tuple(experts.shape)}")
        if blocks.dtype != torch.int64 or blocks.dim() != 1:
            raise ValueError(f"blocks must be an int64 table [experts]; got {blocks.dtype} {tuple(blocks.shape)}")
        rows, experts = rows.contiguous(), experts.contiguous()
        out = torch.empty(m, out_features, dtype=torch.bfloat16)
        if m and launch(self.lib.octavo_amx_linear_experts, rows.data_ptr(), blocks.data_ptr(), experts.data_ptr(),
                        m, k, out_features, out.data_ptr()):
            raise MemoryError("AMX experts kernel could not allocate its padded row tiles")
        return out


class AmxWeight:
    """One weight as the kernel reads it; call it like ``F.linear(x, weight, bias)``."""

    def __init__(self, lib: ctypes.CDLL, blocks: torch.Tensor, out_features: int, in_features: int,
                 owner: Optional[torch.Tensor] = None) -> None:
        self._lib, self.blocks, self._owner = lib, blocks, owner
        self.out_features, self.in_features = out_features, in_features

    def streams_output(self, rows: int) -> bool:
        """Whether the kernel writes the output of ``rows`` rows past the caches (amx_linear.c's
        STREAM_OUT_BYTES and up: an LM head's logits at a decode batch of tens of rows or more)."""
        return bool(self._lib.octavo_amx_streams(rows, self.out_features))

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return amx_multiply(self._lib, x, self.blocks, bias, self.out_features)


def amx_multiply(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                 out_features: int) -> torch.Tensor:
    """``x @ W^T + bias`` for W [out_features, x.shape[-1]] stored as ``blocks`` (blocked_layout)."""
    in_features = blocks.numel() // (-(-out_features // N_BLOCK) * N_BLOCK)
    # On every decode step, ~50 calls a token: the checks stay cheap.
    if x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[-1] != in_features:
        raise ValueError(f"input must be a CPU bfloat16 tensor [..., {in_features}]; "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape[0] != out_features
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous bfloat16 [{out_features}]; "
                         f"got {bias.dtype} {tuple(bias.shape)}")
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    if rows.shape[0] and launch(
        lib.octavo_amx_linear, rows.data_ptr(), blocks.data_ptr(), None if bias is None else bias.data_ptr(),
        rows.shape[0], in_features, out_features, out.data_ptr(),
    ):
        raise MemoryError("AMX linear kernel could not allocate its copied row tiles")
    return out if rows is x else out.view(*x.shape[:-1], out_features)


def amx_linear_kernel(required: bool = False) -> Optional[AmxLinearKernel]:
    """The kernel, built on first use; None where it cannot be built or the CPU
    (or the OS) offers no AMX, unless ``required`` (then a ValueError says why)."""
    return _kernel(cpu_target(), required)


@cache
def _kernel(target: CpuTarget, required: bool) -> Optional[AmxLinearKernel]:
    # Cached: the eager op looks the kernel up on every product.
    lib = kernel_library("amx_linear", target, required=required)
    if lib is None:
        return None
    if not lib.octavo_amx_available():
        if required:
            raise ValueError(f"the AMX linear kernel needs a CPU with AMX bf16 tiles and an OS that grants them "
                             f"(CPU kernels target: {target.name})")
        return None
    return AmxLinearKernel(lib)
