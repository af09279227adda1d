"""The W8A8 kernel (w8a8_linear.c) built for every target this CPU can
execute, each forced, against torch doing the same operations: rows rounded
to int8 per row, an exact integer product (int64 here), one float32 scale
multiply and the bias add. The integer sum is exact on every path, so the
results must be equal bit for bit, not close: 1..64 rows, K not a multiple
of 4 or of 64 (and above 1024, where the torch path splits K), float32 and
bf16 rows, bias, zero rows, weights using -128."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from octavo.kernels.cpu_features import TARGETS
from octavo.kernels.w8a8_linear import pack_w8a8, unpack_w8a8, w8a8_linear_kernel
from octavo.quant.w8a8 import W8A8Weight, quantize_rows, w8a8_product
from tests.kernels.test_bf16_linear import runnable

X86_AND_PORTABLE = [t.name for t in TARGETS if t.arch in ("x86_64", "any")]
# The path w8a8_linear.c compiles to under each target.
ISA = {"amx": "avx512_vnni", "avx512_bf16": "avx512_vnni", "avx512": "avx512", "avx2": "avx2",
       "portable": "portable"}
# (N, K): one block, 5 blocks (a group of 4 and a tail of 1 on VNNI), 7
# blocks; K odd, K % 4 == 2, K % 64 != 0, K > 1024.
SHAPES = [(16, 5), (80, 100), (112, 258), (48, 1100)]
ROWS = [1, 3, 4, 17, 64]


def reference(x: torch.Tensor, q: torch.Tensor, scale_w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Written apart from octavo's torch path: int64 sums, explicit divisions."""
    xf = x.float()
    amax = xf.abs().amax(1)
    sx = torch.where(amax > 0, amax / torch.full_like(amax, 127.0), torch.ones_like(amax))
    xq = torch.round(xf / sx[:, None]).clamp(-127, 127).long()
    acc = (xq @ q.long().T).to(torch.int32)
    out = acc.float() * (sx[:, None] * scale_w[None, :])
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _case(n: int, k: int, rows: int, dtype: torch.dtype, with_bias: bool, gen: torch.Generator):
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale_w = torch.rand(n, generator=gen) * 0.02 + 1e-3
    x = (torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).to(dtype)
    if rows > 2:
        x[rows // 2] = 0  # a zero row: scale 1, output the bias
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    return q, scale_w, x, bias


@pytest.mark.parametrize("target_name", X86_AND_PORTABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_per_target_equals_the_integer_reference(target_name, dtype, with_bias):
    kernel = w8a8_linear_kernel(runnable(target_name), required=True)
    assert kernel.isa == ISA[target_name]
    gen = torch.Generator().manual_seed(7 + with_bias)
    for n, k in SHAPES:
        for rows in ROWS:
            q, scale_w, x, bias = _case(n, k, rows, dtype, with_bias, gen)
            packed, wsum = pack_w8a8(q)
            out = kernel(x, packed, wsum, scale_w, bias, n)
            assert out.dtype == dtype and out.shape == (rows, n)
            want = reference(x, q, scale_w, bias)
            assert torch.equal(out, want), f"{n}x{k}, {rows} rows, {dtype}: max diff {(out - want).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_path_equals_the_reference(dtype):
    """The path for CUDA, no compiler and odd shapes: the same bits (float16 rows too, which only it takes)."""
    gen = torch.Generator().manual_seed(3)
    for n, k in [(24, 7), *SHAPES]:
        q, scale_w, x, bias = _case(n, k, 9, dtype, True, gen)
        assert torch.equal(w8a8_product(x, q, scale_w, bias), reference(x, q, scale_w, bias))


def test_rows_round_to_the_nearest_step_of_their_own_max():
    x = torch.tensor([[0.0, 63.5, -127.0, 0.5, 2.5], [0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.1, 0.0, -0.25]])
    xq, scale = quantize_rows(x)
    assert xq.tolist() == [[0, 64, -127, 0, 2], [0, 0, 0, 0, 0], [0, 0, 51, 0, -127]]  # ties to even
    assert scale.tolist() == [1.0, 1.0, pytest.approx(0.25 / 127)]


def test_weight_packs_and_unpacks_and_runs_natively_where_it_can():
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (32, 10), generator=gen, dtype=torch.int8)
    packed, wsum = pack_w8a8(q)
    assert packed.shape == (2, 3, 16, 4) and torch.equal(wsum, q.sum(1, dtype=torch.int32))
    assert torch.equal(unpack_w8a8(packed, 10), q)
    scale = torch.rand(32, generator=gen)
    weight = W8A8Weight(q, scale)
    assert weight.kernel_name() == f"w8a8 {w8a8_linear_kernel(required=True).isa}"
    x = torch.randn(2, 3, 10, generator=gen)
    assert torch.equal(weight(x), reference(x.view(6, 10), q, scale, None).view(2, 3, 32))
    odd = W8A8Weight(q[:24], scale[:24])  # 24 outputs: not a multiple of 16, the torch path
    assert odd.kernel is None and torch.equal(odd(x), weight(x)[..., :24])


def test_no_rows_give_an_empty_result():
    q = torch.ones(16, 8, dtype=torch.int8)
    packed, wsum = pack_w8a8(q)
    assert w8a8_linear_kernel(required=True)(torch.empty(0, 8), packed, wsum, torch.ones(16), None, 16).shape == (0, 16)


def test_opcheck():
    """The op's schema and fake implementation against real calls (what torch.compile traces)."""
    gen = torch.Generator().manual_seed(11)
    packed, wsum = pack_w8a8(torch.randint(-128, 128, (32, 40), generator=gen, dtype=torch.int8))
    x = torch.randn(5, 40, generator=gen).to(torch.bfloat16)
    bias = torch.randn(32, generator=gen).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.octavo.w8a8_linear, (x, packed, wsum, torch.rand(32, generator=gen), bias, 32))
    torch.library.opcheck(torch.ops.octavo.w8a8_linear, (x.float(), packed, wsum, torch.rand(32), None, 32))
