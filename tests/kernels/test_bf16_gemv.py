"""The native few-row bf16 matmul against torch's F.linear on the same bf16 tensors."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from octavo.kernels.bf16_gemv import Bf16Gemv, bf16_gemv_kernel
from octavo.model.layers.linear import Linear, use_gemv

gemv = bf16_gemv_kernel()
# Both round the same float32 sum to bf16; the sums differ only in order, so
# results agree to one bf16 step of the output's magnitude.
needs_kernel = pytest.mark.skipif(gemv is None, reason="this CPU has no AVX512-BF16: the kernel declines to build")


def _one_ulp(ref: torch.Tensor) -> torch.Tensor:
    return ref.float().abs().clamp(min=1e-3) * 2**-7


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(2048, 768), (768, 2048), (130, 100), (5, 31)])
def test_matches_torch_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    for bias in (None, b):
        ours, ref = gemv(x, w, bias), F.linear(x, w, bias)
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
        assert ((ours.float() - ref.float()).abs() <= _one_ulp(ref)).all()


@needs_kernel
def test_linear_layer_uses_it_for_few_rows_only():
    layer = Linear(64, 96, bias=True).bfloat16()
    use_gemv(layer, gemv)
    calls = []
    original = Bf16Gemv.__call__

    def counting(self, *args):
        calls.append(args[0].shape[0])
        return original(self, *args)

    Bf16Gemv.__call__ = counting
    try:
        for rows in (1, 4, 5, 64):
            x = torch.randn(rows, 64).bfloat16()
            out = layer(x)
            ref = F.linear(x, layer.weight, layer.bias)
            assert ((out.float() - ref.float()).abs() <= _one_ulp(ref)).all()
    finally:
        Bf16Gemv.__call__ = original
    assert calls == [1, 4]  # 5 and 64 rows go to torch's matmul


@needs_kernel
def test_refuses_what_it_cannot_take():
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(ValueError, match="cannot take"):
        gemv(x.float(), torch.randn(8, 32).bfloat16(), None)
    with pytest.raises(ValueError, match="cannot take"):
        gemv(torch.randn(5, 32).bfloat16(), torch.randn(8, 32).bfloat16(), None)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, torch.randn(8, 32).bfloat16(), torch.randn(7).bfloat16())
