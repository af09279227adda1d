"""The quantized weights every format goes through (octavo/quant/qweights.py):
packing round trips exactly, and each weight multiplies like
``x @ dequant(W).T`` for 1, 7, 64 and 300 rows on every path (the native
FMA kernel, the AMX tile kernel, dequantize + F.linear). These are the paths
of float activations (``quantized_activations("float")``); the default, rows
rounded to int8 at few rows, is tests/quant/test_qdot.py's.

How the products are compared: float32 activations go through the exact
path (float32 products and sums), so the result equals the float64
reference within 1e-5 relative (|diff| <= 1e-5 * (|x| @ |W|^T + |b|)): only
the summation order differs. bf16 activations: the output is rounded to bf16
(2^-9 relative) and, past 4 rows, the AMX path multiplies bf16-rounded
weights (2^-9 relative each), so |diff| <= 2^-7 * (|x| @ |W|^T + |b|)."""
from __future__ import annotations

import json

import pytest
import torch

import octavo.quant.qweights as qweights
from octavo.quant import linear_table as cpu_linear
from octavo.kernels.quant_linear import (
    pack_groups,
    pack_int4,
    pack_int8,
    quant_linear_kernel,
    unpack_groups,
    unpack_int4,
    unpack_int8,
)
from octavo.quant.qweights import FMA_ROWS, Int4Weight, Int8Weight, QuantizedWeight, quantized_activations

ROWS = [1, 7, 64, 300]
needs_kernel = pytest.mark.skipif(quant_linear_kernel() is None, reason="no C compiler: the kernel cannot be built")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(n: int, k: int, seed: int, groups: int = 1, zeros: bool = False) -> Int8Weight:
    gen = _gen(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=gen) * 0.01 + 1e-3
    zero = torch.randint(-3, 4, (n, groups), generator=gen).float() if zeros else None
    with quantized_activations("float"):
        return Int8Weight(q, scale.squeeze(1) if groups == 1 else scale, zero)


def _int4(n: int, k: int, group: int, seed: int, perm: bool = False) -> Int4Weight:
    gen = _gen(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    zeros = torch.rand(n, k // group, generator=gen) * 15
    with quantized_activations("float"):
        return Int4Weight(q, scales, zeros, group, torch.randperm(k, generator=gen) if perm else None)


def test_layouts_round_trip_exactly():
    gen = _gen(0)
    q8 = torch.randint(-128, 128, (48, 40), generator=gen, dtype=torch.int8)
    q4 = torch.randint(0, 16, (48, 40), generator=gen, dtype=torch.uint8)
    groups = torch.randn(48, 5, generator=gen)
    assert torch.equal(unpack_int8(pack_int8(q8)), q8)
    assert torch.equal(unpack_int4(pack_int4(q4)), q4)
    assert torch.equal(unpack_groups(pack_groups(groups)), groups)
    assert pack_int4(q4).numel() == q4.numel() // 2  # two values a byte


@pytest.mark.parametrize("make", [lambda: _int8(64, 96, seed=1), lambda: _int8(64, 96, seed=2, groups=3, zeros=True),
                                  lambda: _int4(64, 96, 32, seed=3), lambda: _int4(64, 96, 32, seed=4, perm=True)])
def test_weights_keep_their_integers_and_factors(make):
    w: QuantizedWeight = make()
    q, scales, mins = w.unpack()
    ref = make()  # same seed: the canonical inputs again
    assert torch.equal(q, ref.unpack()[0]) and torch.equal(scales, ref.unpack()[1])
    expected = q.float() * scales.repeat_interleave(w.group_size, 1)
    if mins is not None:
        expected += mins.repeat_interleave(w.group_size, 1)
    assert torch.equal(w.dequantize(), expected)


def _reference(w: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x @ dequant(W).T + b, and the bound's scale |x| @ |W|^T + |b|."""
    x64 = x.double() if w.perm is None else x.double().index_select(-1, w.perm)
    w64 = w.dequantize().double()
    return x64 @ w64.T + bias.double(), x64.abs() @ w64.abs().T + bias.double().abs()


def _check(w: QuantizedWeight, rows: int, dtype: torch.dtype, seed: int) -> None:
    gen = _gen(seed)
    x = torch.randn(rows, w.in_features, generator=gen).to(dtype)
    bias = torch.randn(w.out_features, generator=gen).to(dtype)
    out = w(x, bias)
    assert out.dtype == dtype and out.shape == (rows, w.out_features)
    ref, scale = _reference(w, x, bias)
    rel = 1e-5 if dtype == torch.float32 else 2**-7
    worst = ((out.double() - ref).abs() / scale).max().item()
    assert worst <= rel, f"{rows} rows, {dtype}: error {worst:.2e} of the scale, bound {rel:.1e}"


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int8_grouped", "int4_g32", "int4_g128_perm"])
def test_native_kernels_multiply_like_the_dequantized_weight(kind, dtype, rows):
    w = {"int8": lambda: _int8(96, 256, seed=5),
         "int8_grouped": lambda: _int8(96, 256, seed=6, groups=4, zeros=True),
         "int4_g32": lambda: _int4(96, 256, 32, seed=7),
         "int4_g128_perm": lambda: _int4(96, 256, 128, seed=8, perm=True)}[kind]()
    assert w.kernel is not None
    _check(w, rows, dtype, seed=rows)


@needs_kernel
def test_bf16_rows_past_the_fma_limit_take_the_amx_kernel_where_the_cpu_has_it():
    w = _int4(64, 128, 32, seed=9)
    assert w.amx == quant_linear_kernel().has_amx
    fma = f"int4 fma {quant_linear_kernel().isa}"
    assert w.kernel_name() == (f"{fma} (<= 4 rows) + amx" if w.amx else f"{fma} (> 64 rows: measured, fma or dequantize)")
    _check(w, FMA_ROWS + 1, torch.bfloat16, seed=1)


@needs_kernel
@pytest.mark.parametrize("way", ["fma", "dequantize"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_many_row_ways_multiply_like_the_dequantized_weight(monkeypatch, way, dtype):
    # Without AMX a product of more than FMA_ALWAYS_ROWS rows goes the way the table measured.
    monkeypatch.setattr(QuantizedWeight, "_many_rows_way", lambda self, rows, dtype: way)
    for w in (_int8(96, 256, seed=14, groups=4, zeros=True), _int4(96, 256, 128, seed=15, perm=True)):
        w.amx = False
        _check(w, qweights.FMA_ALWAYS_ROWS + 36, dtype, seed=3)


@needs_kernel
def test_the_many_row_way_is_measured_once_per_shape_and_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    w = _int8(96, 256, seed=16)
    w.amx = False
    _check(w, 300, torch.bfloat16, seed=4)  # measured now, at both buckets
    (table,) = tmp_path.glob("kernels/linear-table-*.json")
    saved = json.loads(table.read_text())
    for bucket in qweights.MANY_ROW_BUCKETS:
        assert saved[f"int8g256:96x256:bfloat16@{bucket}"] in ("fma", "dequantize")
        assert saved[f"int8g256:96x256:bfloat16@{bucket}:fma_ms"] > 0
        assert saved[f"int8g256:96x256:bfloat16@{bucket}:dequantize_ms"] > 0

    def no_measuring(*_):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_linear, "_best_seconds_in_turns", no_measuring)
    again = _int8(96, 256, seed=17)  # the same shape: read from the table
    again.amx = False
    _check(again, 1500, torch.bfloat16, seed=5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, FMA_ROWS + 3])
def test_compiled_quantized_product_matches_eager(rows):
    # The kernel is the torch op octavo::quant_linear: torch.compile traces it whole (fullgraph), on both the
    # FMA and (where the CPU has AMX) the tile path.
    w = _int4(64, 128, 32, seed=13)
    x = torch.randn(rows, 128, generator=_gen(rows)).to(torch.bfloat16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return w(x).float().relu()

    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))


@pytest.mark.parametrize("rows", ROWS)
def test_the_torch_path_multiplies_like_the_dequantized_weight(monkeypatch, rows):
    """Where the kernel is missing (no compiler, not x86, CUDA) the weight is
    kept as plain integers and dequantized per call."""
    monkeypatch.setattr(qweights, "quant_linear_kernel", lambda: None)
    for w in (_int8(40, 64, seed=10), _int4(40, 64, 16, seed=11, perm=True)):
        assert w.kernel is None and w.kernel_name().endswith("dequantize + F.linear")
        _check(w, rows, torch.float32, seed=rows)


def test_a_leading_batch_shape_is_kept():
    w = _int4(32, 64, 32, seed=12)
    x = torch.randn(2, 3, 64)
    assert torch.allclose(w(x), w(x.view(6, 64)).view(2, 3, 32))


def test_bad_canonical_tensors_are_refused_naming_what_is_wrong():
    q4 = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="q must be uint8"):
        Int4Weight(q4.to(torch.int8), torch.ones(32, 2), torch.zeros(32, 2), 32)
    with pytest.raises(ValueError, match="above 15"):
        Int4Weight(q4 * 2, torch.ones(32, 2), torch.zeros(32, 2), 32)
    with pytest.raises(ValueError, match="scales must be"):
        Int4Weight(q4, torch.ones(32, 3), torch.zeros(32, 3), 32)
    with pytest.raises(ValueError, match="zeros must be"):
        Int4Weight(q4, torch.ones(32, 2), torch.zeros(32, 1), 32)
    with pytest.raises(ValueError, match="perm must be"):
        Int4Weight(q4, torch.ones(32, 2), torch.zeros(32, 2), 32, torch.arange(63))
    with pytest.raises(ValueError, match="q must be int8"):
        Int8Weight(q4, torch.ones(32))
    with pytest.raises(ValueError, match="input must be"):
        Int8Weight(q4.to(torch.int8), torch.ones(32))(torch.randn(2, 63))


@needs_kernel
@pytest.mark.parametrize("rows", [2, 3, FMA_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_blocks_of_the_few_row_kernels(dtype, rows):
    """2-4 rows share each widened weight vector."""
    for w in (_int8(64, 128, seed=13), _int4(64, 128, 32, seed=14), _int4(64, 128, 64, seed=15, perm=True)):
        _check(w, rows, dtype, seed=rows)
