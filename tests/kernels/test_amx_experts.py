"""The AMX experts kernels: a mixture of experts' products for every expert in one call, rows sorted by
expert, each expert given 0, 1, 5, 8, 16, 17 or 33 rows (none; one; past the few-row kernels' 4; Mixtral's
~8 at 32 requests, all read in place with the tiles configured to the run's rows; one whole tile; a whole
tile and a padded one; two whole tiles and a padded one), against one product per expert on the same bytes and
against float references. bf16 experts prepacked for oneDNN (amx_linear.c) and int8/int4 ones
dequantized a group at a time (quant_linear.c). Both are built for the amx target only: under the
other targets experts take the per-expert and few-row paths (tests/quant/test_grouped_experts.py)."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from octavo.kernels.amx_linear import amx_linear_kernel
from octavo.kernels.quant_linear import quant_linear_kernel
from octavo.quant.moe import GroupedProduct
from octavo.quant.onthefly import quantize_int4, quantize_int8
from octavo.quant.unquantized import PackedWeight, can_pack

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16) or amx_linear_kernel() is None,
    reason="needs a CPU (and OS) with AMX bf16 tiles",
)

COUNTS = [0, 1, 5, 8, 16, 17, 33]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _sorted_rows(in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [sum(COUNTS), in_features] and their experts, COUNTS[e] rows of expert e, sorted by expert."""
    experts = torch.tensor([e for e, count in enumerate(COUNTS) for _ in range(count)], dtype=torch.int64)
    return _randn(len(experts), in_features, seed=99), experts


def _assert_rounded_from(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out is the float32 result ``ref`` rounded once to bf16 (up to the sum order)."""
    err = (out.float() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-3).all(), f"max error {err.max().item()}"


# Outputs not a multiple of 32 (a padded last group) and K of one and several blocks.
@pytest.mark.parametrize("out_features,in_features", [(200, 96), (64, 32)])
def test_bf16_experts_kernel_gives_each_row_its_own_experts_product(out_features, in_features):
    amx = amx_linear_kernel(required=True)
    weights = [_randn(out_features, in_features, seed=e) for e in range(len(COUNTS))]
    packed = [PackedWeight.of(w, amx) for w in weights]
    assert all(p.amx is not None for p in packed), "oneDNN's packed layout changed: the kernel no longer reads it"
    blocks = torch.tensor([p.amx.blocks.data_ptr() for p in packed], dtype=torch.int64)
    x, experts = _sorted_rows(in_features)
    out = amx.experts(x, blocks, experts, out_features)
    assert out.shape == (len(experts), out_features) and out.dtype == torch.bfloat16
    for e, weight in enumerate(weights):
        rows = (experts == e).nonzero().flatten()
        if rows.numel():
            assert torch.equal(out[rows], packed[e].amx(x[rows])), f"expert {e}: not the one-expert kernel's bits"
            _assert_rounded_from(out[rows], F.linear(x[rows].float(), weight.float()))
    assert amx.experts(x[:0], blocks, experts[:0], out_features).shape == (0, out_features)
    torch.library.opcheck(torch.ops.octavo.amx_linear_experts, (x, blocks, experts, out_features))
    with pytest.raises(ValueError, match=r"^experts must be int64 \[80\]"):
        amx.experts(x, blocks, experts[:3], out_features)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        amx.experts(_randn(len(experts), 40, seed=1), blocks, experts, out_features)


@pytest.mark.parametrize("quantize", [quantize_int8, lambda w: quantize_int4(w, 32)], ids=["int8", "int4"])
def test_quantized_experts_kernel_gives_each_row_its_own_experts_product(quantize):
    """Each expert's rows get the bits that expert's own AMX product gives them (the same dequantized
    groups, the same tiles), within bf16 rounding of the float product by the dequantized weight."""
    assert quant_linear_kernel(required=True).has_amx
    weights = [quantize(_randn(96, 128, seed=e).float() * (1 + e)) for e in range(len(COUNTS))]
    product = GroupedProduct.of(weights, amx=True)
    assert product is not None
    x, experts = _sorted_rows(128)
    out = product(x, experts)
    for e, weight in enumerate(weights):
        rows = (experts == e).nonzero().flatten()
        if rows.numel():
            alone = weight._kernel_product(x[rows].contiguous(), None, True)
            assert torch.equal(out[rows], alone), f"expert {e}"
            ref = F.linear(x[rows].float(), weight.dequantize())
            assert (out[rows].float() - ref).abs().max() <= 2**-6 * ref.abs().max()
    torch.library.opcheck(torch.ops.octavo.quant_linear_experts,
                          (x, experts, product.weights[0].bits, product.weights[0].group_size, product.packed,
                           product.scales, product.mins, product.weights[0].out_features))
    with pytest.raises(ValueError, match=r"^experts must be int64 \[80\]"):
        product(x, experts[:3])
