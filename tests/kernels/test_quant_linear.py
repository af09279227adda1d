"""The int8/int4 kernel (quant_linear.c) built for every target this CPU can
execute, each forced, against torch's dequantize-then-matmul on odd shapes:
int8 and int4, with and without mins (zero points) and bias, 1..64 rows,
float32 and bf16 rows.

The bounds are those of tests/quant/test_qweights.py: the FMA path's
products are exact and its sums float32 in another order than the float64
reference, so float32 rows are within 1e-5 of |x| @ |W|^T + |b|; bf16 rows
add one rounding of the output to bf16 (bound 2^-7)."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from octavo.kernels.cpu_features import TARGETS, cpu_info
from octavo.kernels.quant_linear import pack_groups, pack_int4, pack_int8, quant_linear_kernel
from tests.kernels.test_bf16_linear import ISA, runnable

X86_AND_PORTABLE = [t.name for t in TARGETS if t.arch in ("x86_64", "any")]
# (out features N, in features K, group): N a multiple of 16 (the packed
# block), K and the group multiples of 4 (the kernel's k step); one group, a
# group of 4, groups not a power of two.
SHAPES = [(16, 4, 4), (48, 36, 12), (112, 264, 264), (32, 100, 20), (96, 256, 32)]
ROWS = [1, 2, 3, 4, 5, 7, 16, 33, 64]


def _weight(bits: int, n: int, k: int, group: int, mins: bool, gen: torch.Generator):
    """Integers q [N, K], scales and mins [N, K/group] as the kernel reads them (mins None or float)."""
    if bits == 8:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    zero_points = torch.rand(n, k // group, generator=gen) * 15 if mins else None
    return q, scales, None if zero_points is None else -zero_points * scales


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], group: int,
               bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch: dequantize, then matmul (float64), and the bound's scale |x| @ |W|^T + |b|."""
    w = q.double() * scales.double().repeat_interleave(group, 1)
    if mins is not None:
        w += mins.double().repeat_interleave(group, 1)
    b = torch.zeros(q.shape[0], dtype=torch.float64) if bias is None else bias.double()
    return x.double() @ w.T + b, x.double().abs() @ w.abs().T + b.abs()


def _run(kernel, x, bits, group, q, scales, mins, bias) -> torch.Tensor:
    packed = pack_int8(q) if bits == 8 else pack_int4(q)
    return kernel(x, bits, group, packed, pack_groups(scales), None if mins is None else pack_groups(mins), bias,
                  q.shape[0], False)


@pytest.mark.parametrize("target_name", X86_AND_PORTABLE)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fma_path_per_target_matches_dequantize_then_matmul(target_name, bits, mins, with_bias):
    kernel = quant_linear_kernel(runnable(target_name), required=True)
    assert kernel.isa == ISA[target_name]
    if target_name != "amx":
        assert not kernel.has_amx  # the tile path exists only in the amx target's build
    gen = torch.Generator().manual_seed(bits * 8 + 2 * mins + with_bias)
    for n, k, group in SHAPES:
        q, scales, mn = _weight(bits, n, k, group, mins, gen)
        for rows in ROWS:
            for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
                x = torch.randn(rows, k, generator=gen).to(dtype)
                bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
                out = _run(kernel, x, bits, group, q, scales, mn, bias)
                assert out.dtype == dtype and out.shape == (rows, n)
                ref, scale = _reference(x, q, scales, mn, group, bias)
                worst = ((out.double() - ref).abs() / scale).max().item()
                assert worst <= bound, f"{n}x{k} g{group}, {rows} rows, {dtype}: {worst:.2e} of the scale"


@pytest.mark.parametrize("bits", [8, 4])
def test_every_target_gives_the_same_bits_where_sums_are_exact(bits):
    """Small integer rows, power-of-two scales and mins: every product and
    partial sum is exact in float32, so each path, whatever its summation
    order, must return exactly torch's float32 result."""
    gen = torch.Generator().manual_seed(bits)
    n, k, group = 48, 72, 24
    q, _, _ = _weight(bits, n, k, group, False, gen)
    scales = 2.0 ** torch.randint(-6, -2, (n, k // group), generator=gen).float()
    mins = -(2.0 ** torch.randint(-4, 0, (n, k // group), generator=gen).float())
    bias = torch.randint(-8, 9, (n,), generator=gen).float()
    for rows in (1, 3, 4, 9):
        x = torch.randint(-4, 5, (rows, k), generator=gen).float()
        ref = x @ (q.float() * scales.repeat_interleave(group, 1) + mins.repeat_interleave(group, 1)).T + bias
        for target in TARGETS:
            if target.name in X86_AND_PORTABLE and cpu_info().can_run(target):
                out = _run(quant_linear_kernel(target, required=True), x, bits, group, q, scales, mins, bias)
                assert torch.equal(out, ref), (target.name, rows)


def test_no_rows_give_an_empty_result():
    kernel = quant_linear_kernel(required=True)
    q, scales, _ = _weight(8, 32, 16, 16, False, torch.Generator().manual_seed(0))
    assert _run(kernel, torch.empty(0, 16), 8, 16, q, scales, None, None).shape == (0, 32)
