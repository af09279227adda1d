"""The AMX linear kernel against a float32 reference, on oneDNN's own packed
bytes (the layers' choice of path: tests/quant/test_unquantized.py)."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from octavo.kernels.amx_linear import AmxLinearKernel, amx_linear_kernel, blocked_layout
from octavo.quant.unquantized import can_pack

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16) or amx_linear_kernel() is None,
    reason="this CPU (or OS) offers no AMX bf16 tiles",
)


@pytest.fixture(scope="module")
def amx() -> AmxLinearKernel:
    return amx_linear_kernel(required=True)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 128)


def _kernel_weight(amx: AmxLinearKernel, weight: torch.Tensor):
    shared = amx.share_onednn(_onednn(weight), weight)
    assert shared is not None, "oneDNN's packed layout changed: the kernel no longer reads it"
    return shared


def _assert_rounded_from(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out is the float32 result ``ref`` rounded once to bf16 (up to the sum order)."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    err = (out.float() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-3).all(), f"max error {err.max().item()}"


def _assert_matches_float32(amx: AmxLinearKernel, rows: int, out_features: int, in_features: int,
                            bias: bool) -> None:
    weight = _randn(out_features, in_features, seed=rows)
    b = _randn(out_features, seed=1) if bias else None
    x = _randn(rows, in_features, seed=2)
    ref = F.linear(x.float(), weight.float(), None if b is None else b.float())
    _assert_rounded_from(_kernel_weight(amx, weight)(x, b), ref)


# Row counts around the 16-row tiles (one tile in place, from two copied into
# tile order), the 32-row pairs and an odd last tile, and past one pass of
# copied tiles (~1 MiB: 672 rows at K = 768, 256 at K = 2048); outputs not a
# multiple of 32 (a padded last group, a half one); K of one and several blocks.
@pytest.mark.parametrize("rows", [1, 2, 4, 15, 16, 17, 31, 32, 33, 64, 100, 256, 700])
@pytest.mark.parametrize("out_features,in_features", [(200, 96), (48, 32), (1280, 768), (96, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_reference(amx, rows, out_features, in_features, bias):
    _assert_matches_float32(amx, rows, out_features, in_features, bias)


# Outputs of 4 MiB and more (an LM head's logits) are written past the caches
# from 17 rows (33 and 256 here): whole 32-output rows at 64-byte aligned
# addresses; the rest (at N = 65552 every other row, and the padded last group)
# stored as the others are.
@pytest.mark.parametrize("rows", [1, 4, 17, 33, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_large_outputs_match_float32_reference(amx, rows, bias):
    _assert_matches_float32(amx, rows, 65552, 64, bias)


def test_oneDNN_bytes_are_the_blocked_layout(amx):
    """The byte-for-byte check behind share_onednn: oneDNN's buffer is read in
    place (no copy) and holds exactly blocked_layout(weight)."""
    weight = _randn(96, 64, seed=3)
    packed = _onednn(weight)
    shared = amx.share_onednn(packed, weight)
    assert shared.blocks.data_ptr() == torch.ops.mkldnn.data_ptr(packed)
    assert torch.equal(shared.blocks.view(torch.int16), blocked_layout(weight).view(-1).view(torch.int16))


def test_another_weights_bytes_are_refused(amx):
    weight = _randn(64, 64, seed=4)
    assert amx.share_onednn(_onednn(_randn(64, 64, seed=5)), weight) is None


def test_input_dims_are_kept(amx):
    weight = _randn(64, 32, seed=6)
    x = _randn(2, 3, 32, seed=7)
    layer = _kernel_weight(amx, weight)
    out = layer(x)
    assert out.shape == (2, 3, 64)
    _assert_rounded_from(out, F.linear(x.float(), weight.float()))
    assert layer(x[:0]).shape == (0, 3, 64)


def test_bad_inputs_are_refused(amx):
    weight = _randn(64, 32, seed=8)
    layer = _kernel_weight(amx, weight)
    with pytest.raises(ValueError, match="input must be a CPU bfloat16 tensor"):
        layer(torch.randn(1, 32))
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\]"):
        layer(_randn(1, 48, seed=9))
    with pytest.raises(ValueError, match="bias must be contiguous bfloat16"):
        layer(_randn(1, 32, seed=9), torch.zeros(64))
    assert not amx.fits(_randn(64, 40, seed=10))  # K = 40: not whole 32-blocks
    assert amx.share_onednn(_onednn(_randn(64, 40, seed=10)), _randn(64, 40, seed=10)) is None
