"""bf16 weights prepacked for oneDNN give torch's own F.linear results."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from octavo.model.layers.linear import Linear, can_pack, pack_weights

needs_packing = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16), reason="this torch build/CPU has no oneDNN bf16"
)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 128, 300])
def test_packed_equals_plain(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=bias).bfloat16()
    weight, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    assert pack_weights(layer) == 1
    assert layer.weight.device.type == "meta"  # the plain copy is freed
    x = torch.randn(rows, 96).bfloat16()
    out = layer(x)
    ref = F.linear(x, weight, b)
    # Same float32 sums rounded to bf16; at most one step apart where the order differs.
    assert ((out.float() - ref.float()).abs() <= ref.float().abs().clamp(min=1e-3) * 2**-7).all()


@needs_packing
def test_shared_weight_is_kept_for_its_other_user():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 32).bfloat16()
            self.head = Linear(32, 50, bias=False).bfloat16()
            self.head.weight = self.embed.weight

    model = Tied()
    pack_weights(model)
    assert model.embed.weight.device.type == "cpu"  # the embedding still reads it
    ids = torch.tensor([3, 7])
    ref = F.linear(model.embed(ids), model.embed.weight)
    out = model.head(model.embed(ids))
    assert ((out.float() - ref.float()).abs() <= ref.float().abs().clamp(min=1e-3) * 2**-7).all()


def test_float32_layers_are_left_alone():
    layer = Linear(8, 4)
    assert pack_weights(layer) == 0 and layer.packed is None
    assert not can_pack(torch.device("cpu"), torch.float32)
