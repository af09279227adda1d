"""Quantization of K/V rows (kv_quant.py): the dequantization error per
element, all-zero rows, static scales that saturate, and gathers that
dequantize blocks in their table's order."""
from __future__ import annotations

import pytest
import torch

from octavo.attention.kv_quant import allocate_layer_cache, dequantize, gather_blocks, quantize, write_kv

CPU = torch.device("cpu")


def _rows(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, with outliers: each row gets its own scale.
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-3, 2, 64)[:, None, None]
    x[::7, :, 5] *= 30
    return x


def test_int8_error_is_within_half_a_step():
    x = _rows(0)
    values, scales = quantize(x, torch.int8)
    assert values.dtype == torch.int8 and scales.shape == (64, 4)
    torch.testing.assert_close(scales, x.abs().amax(-1) / 127)  # the largest element maps to +-127
    error = (dequantize(values, scales, torch.float32) - x).abs()
    # Half a step, plus float32 rounding of x / scale and of the product.
    assert (error <= scales[..., None] * (0.5 + 1e-5)).all()
    assert values.abs().max() == 127


def test_fp8_error_is_within_e4m3_rounding():
    """e4m3 keeps 3 mantissa bits: a value is off by at most half a unit in
    its last place (2^(e - 4) for |x / scale| in [2^e, 2^(e+1))); below 2^-6
    (subnormals) by at most half of 2^-9."""
    x = _rows(1)
    values, scales = quantize(x, torch.float8_e4m3fn)
    assert values.dtype == torch.float8_e4m3fn
    y = (x / scales[..., None]).abs()
    exponent = torch.floor(torch.log2(y.clamp(min=2.0**-6)))
    half_ulp = torch.where(y < 2.0**-6, torch.full_like(y, 2.0**-10), 2.0 ** (exponent - 4))
    error = (dequantize(values, scales, torch.float32) - x).abs()
    assert (error <= (half_ulp * (1 + 1e-5)) * scales[..., None]).all()
    assert values.float().abs().max() == 448


def test_all_zero_rows_are_stored_exactly():
    x = torch.zeros(3, 2, 16)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        values, scales = quantize(x, dtype)
        assert (scales == 1).all() and (dequantize(values, scales, torch.float32) == 0).all()


@pytest.mark.parametrize("dtype,qmax", [(torch.int8, 127), (torch.float8_e4m3fn, 448)])
def test_static_scales_serve_every_row_and_saturate(dtype, qmax):
    static = torch.tensor([0.01, 0.1])
    # Head 0: 0.32 / 0.01 = 32 fits both types; -10 / 0.01 = -1000 does not. Head 1: 100 / 0.1 neither.
    x = torch.tensor([[[0.32, -10.0], [1.0, 100.0]]])
    values, scales = quantize(x, dtype, static)
    assert torch.equal(scales, static[None])
    deq = dequantize(values, scales, torch.float32)
    assert deq[0, 0, 0].item() == pytest.approx(0.32) and deq[0, 1, 0].item() == pytest.approx(1.0)
    assert deq[0, 0, 1].item() == pytest.approx(-qmax * 0.01) and deq[0, 1, 1].item() == pytest.approx(qmax * 0.1)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_gather_dequantizes_blocks_in_table_order(dtype):
    cache = allocate_layer_cache(5, 4, 2, 8, dtype, CPU)
    k, v = _rows(2)[:20, :2, :8], _rows(3)[:20, :2, :8]
    write_kv(cache, k, v, torch.arange(20))
    table = torch.tensor([[3, 0], [4, 1]])
    keys = gather_blocks(cache, 0, table, torch.float32)
    values = gather_blocks(cache, 1, table, torch.float32)
    assert keys.shape == (2, 8, 2, 8)
    for row, blocks in enumerate(table.tolist()):
        slots = torch.cat([torch.arange(b * 4, b * 4 + 4) for b in blocks])
        for got, want in ((keys[row], k[slots]), (values[row], v[slots])):
            q, s = quantize(want, dtype)
            torch.testing.assert_close(got, dequantize(q, s, torch.float32), rtol=0, atol=0)
