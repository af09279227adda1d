"""int8/int4 weights times rows rounded to int8 (octavo/kernels/qdot_linear.c),
the default at few rows: under every CPU target this machine runs (VNNI,
AVX2, portable C) the product equals a torch reference doing the same
rounding (tests/quant/q8_0_rows.py, llama.cpp's Q8_0) and the same integer
sums: exact integers, so the float32 result differs only by summation order
(|diff| <= 1e-5 * the sum of the terms' magnitudes); bf16 results by one
more rounding to bf16."""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from octavo.config import ModelConfig
from octavo.kernels.cpu_features import TARGETS, cpu_info
from octavo.kernels.qdot_linear import qdot_linear_kernel
from octavo.quant.qweights import QDOT_ROWS, Int4Weight, Int8Weight, QuantizedWeight, quantized_activations
from tests.quant.q8_0_rows import round_q8_0

needs_kernel = pytest.mark.skipif(qdot_linear_kernel() is None, reason="no C compiler: the kernel cannot be built")
RUNNABLE = [t for t in TARGETS if cpu_info().can_run(t)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(kind: str, n: int = 48, k: int = 256) -> QuantizedWeight:
    gen = _gen(len(kind))
    if kind.startswith("int8"):
        groups = 1 if kind == "int8" else k // 64
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, groups, generator=gen) * 0.01 + 1e-3
        zero = torch.randint(-3, 4, (n, groups), generator=gen).float() if kind == "int8_zeros" else None
        return Int8Weight(q, scale, zero)
    group = 32 if kind.startswith("int4_g32") else 128
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    zeros = torch.full((n, k // group), 8.0) if kind.endswith("sym") else torch.rand(n, k // group, generator=gen) * 15
    perm = torch.randperm(k, generator=gen) if kind.endswith("perm") else None
    return Int4Weight(q, scales, zeros, group, perm)


def _reference(w: QuantizedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 out = sum_g s_g * sum_b d_b * isum(q, xq)_b + m_g * sum_b d_b * isum(xq)_b (+ bias), and the
    bound's scale: the same sum of the terms' magnitudes."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    q, scales, mins = w.unpack()
    xq, d = round_q8_0(x)
    values = (xq.double().unflatten(-1, (-1, 32)) * d.double().unsqueeze(-1)).flatten(-2)
    weight = q.double() * scales.double().repeat_interleave(w.group_size, 1)
    if mins is not None:
        weight += mins.double().repeat_interleave(w.group_size, 1)
    b = torch.zeros(w.out_features, dtype=torch.float64) if bias is None else bias.double()
    return values @ weight.T + b, values.abs() @ weight.abs().T + b.abs()


def _check(out: torch.Tensor, w: QuantizedWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    ref, scale = _reference(w, x, bias)
    rel = 1e-5 if x.dtype == torch.float32 else 2**-8
    worst = ((out.double() - ref).abs() / scale).max().item()
    assert worst <= rel, f"{x.shape[0]} rows, {x.dtype}: error {worst:.2e} of the scale, bound {rel:.1e}"


def _rows(count: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(count, k, generator=_gen(seed)) * torch.rand(count, k, generator=_gen(seed + 1)) * 4
    x[0, 32:64] = 0  # an all-zero block: d = 0, every q 0
    return x.to(dtype)


@needs_kernel
@pytest.mark.parametrize("target", RUNNABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["int8", "int8_zeros", "int4_g32_sym", "int4_g32", "int4_g128_perm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounded_rows_times_the_weight_equal_the_torch_reference_under_every_target(target, kind, dtype):
    kernel = qdot_linear_kernel(target, required=True)
    w = _weight(kind)
    for rows in range(1, QDOT_ROWS + 3):  # past MAX_ROWS the kernel takes the rows in blocks of 4
        x = _rows(rows, w.in_features, dtype, seed=rows)
        bias = torch.randn(w.out_features, generator=_gen(rows)).to(dtype)
        xp = x if w.perm is None else x.index_select(-1, w.perm)
        out = kernel(xp.contiguous(), w.bits, w.group_size, w.packed, w.scales, w.mins, bias, w.out_features)
        assert out.dtype == dtype and out.shape == (rows, w.out_features)
        _check(out, w, x, bias)


@needs_kernel
def test_halves_round_away_from_zero_as_llama_cpp_does():
    """A block whose max is 127 has d = 1: x = 2.5 rounds to 3 (C's roundf, not torch.round's even 2).
    An identity-like weight reads the rounded values back."""
    k = 64
    x = torch.linspace(-126.5, 126.5, k)
    x[0], x[32] = 127.0, -127.0
    w = Int8Weight(torch.eye(k, dtype=torch.int8) * 1, torch.ones(k))
    got = w(x.unsqueeze(0))[0]
    expected = torch.tensor([math.copysign(math.floor(abs(v) + 0.5), v) for v in x.tolist()])
    assert torch.equal(got, expected)
    assert not torch.equal(got, torch.round(x))  # ties to even would differ


@needs_kernel
@pytest.mark.parametrize("target", RUNNABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("bits", [8, 4])
def test_the_vector_rounding_is_the_scalar_rule_to_the_bit_under_every_target(target, bits):
    """Ties, values a float32 step either side of a tie, and blocks whose 1 / d is not exact: an identity
    weight reads each rounded value back as q * d, which the torch reference must equal exactly."""
    k = 96
    x = torch.randn(3, k, generator=_gen(bits)) * 3
    ties = torch.arange(-15.5, 16.5, 1.0)  # d = 1 where the block's max is 127: each v * (1 / d) a tie
    x[0, :32] = ties
    x[0, 0] = 127.0
    x[1, :32] = torch.nextafter(ties, torch.zeros_like(ties))  # just short of a tie
    x[1, 32:64] = torch.nextafter(ties, ties * 2)  # just past one
    x[1, 0], x[1, 32] = -127.0, 127.0
    x[2, 64:] = 0
    kernel = qdot_linear_kernel(target, required=True)
    if bits == 8:
        w = Int8Weight(torch.eye(k, dtype=torch.int8), torch.ones(k))
    else:
        w = Int4Weight(torch.eye(k, dtype=torch.uint8), torch.ones(k, k // 32), torch.zeros(k, k // 32), 32, None)
    got = kernel(x, w.bits, w.group_size, w.packed, w.scales, w.mins, None, k)
    q, d = round_q8_0(x)
    assert torch.equal(got, (q.unflatten(-1, (-1, 32)) * d.unsqueeze(-1)).flatten(-2))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_round_by_default_and_more_rows_or_float_mode_do_not(dtype):
    w = _weight("int4_g32")
    assert w.qdot is not None and "q8_0 rows" in w.kernel_name()
    x = _rows(QDOT_ROWS, w.in_features, dtype, seed=3)
    _check(w(x), w, x, None)
    with quantized_activations("float"):
        exact = _weight("int4_g32")
    assert exact.qdot is None and "q8_0" not in exact.kernel_name()
    more = _rows(QDOT_ROWS + 1, w.in_features, dtype, seed=4)
    assert torch.equal(w(more), exact(more))  # past QDOT_ROWS the float path, as in float mode
    assert not torch.equal(w(x), exact(x))


@needs_kernel
def test_groups_that_are_not_whole_blocks_keep_float_rows():
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    w = Int4Weight(q, torch.rand(32, 4), torch.full((32, 4), 8.0), 16)
    assert w.qdot is None


def test_an_unknown_mode_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="^quantized_activations must be one of int8, float"):
        with quantized_activations("int4"):
            pass
    with pytest.raises(ValueError, match="^quantized_activations must be one of int8, float"):
        ModelConfig(model="m", quantized_activations="fp8")


@needs_kernel
def test_compiled_rounded_product_matches_eager():
    # octavo::qdot_linear is a torch op: torch.compile traces it whole (fullgraph).
    w = _weight("int8_zeros")
    x = _rows(2, w.in_features, torch.bfloat16, seed=5)

    def f(x: torch.Tensor) -> torch.Tensor:
        return w(x).float().relu()

    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
