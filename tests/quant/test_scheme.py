"""The per-layer quantization seam: a scheme picks each linear layer's method
by the layer's checkpoint module path, and fused layers place a parameter
packed along its output dim (int4 nibbles in int32) by whole packed elements."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

from octavo.distributed.parallel_state import ParallelState, parallel_state
from octavo.model.backends import ModelBackends
from octavo.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from octavo.model.loader import load_model
from octavo.quant.base import LinearMethod, QuantizationScheme, set_weight_attrs
from octavo.quant.unquantized import UnquantizedLinearMethod


class _Recording(QuantizationScheme):
    def __init__(self) -> None:
        self.asked: list[str] = []

    def linear_method(self, prefix: str) -> LinearMethod:
        self.asked.append(prefix)
        return UnquantizedLinearMethod()


def test_every_linear_layer_is_chosen_by_its_checkpoint_path(variant):
    scheme = _Recording()
    model, arch = load_model(variant("llama"), "float32", backends=ModelBackends(quantization=scheme))
    expected = ["lm_head"] + [
        f"model.layers.{i}.{name}"
        for i in range(arch.num_layers)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]
    assert sorted(scheme.asked) == sorted(expected)
    prefixes = {m.prefix for m in model.modules() if hasattr(m, "linear_method")}
    assert prefixes == set(expected)


class _PackedColumns(LinearMethod):
    """8 int4 values per int32 along the outputs, like AWQ's qweight [K, N/8]."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        qweight = nn.Parameter(torch.empty(input_size, sum(output_sizes) // 8, dtype=torch.int32),
                               requires_grad=False)
        set_weight_attrs(qweight, output_dim=1, input_dim=0, packed_dim=1, pack_factor=8)
        layer.register_parameter("qweight", qweight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def kernel_name(self, layer: nn.Module) -> str:
        return "none"


def _ints(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_layer_places_packed_parts_by_packed_elements(tp):
    gate, up = _ints(16, 64 // 8, seed=1), _ints(16, 64 // 8, seed=2)
    shards = []
    for rank in range(tp):
        with parallel_state(ParallelState(tp_rank=rank, tp_size=tp)):
            layer = MergedColumnParallelLinear(16, [64, 64], False, _PackedColumns())
        layer.qweight.weight_loader(layer.qweight, gate, 0)
        layer.qweight.weight_loader(layer.qweight, up, 1)
        shards.append(layer.qweight.data)
    cols = 8 // tp
    for rank, shard in enumerate(shards):
        assert torch.equal(shard[:, :cols], gate[:, rank * cols:(rank + 1) * cols])
        assert torch.equal(shard[:, cols:], up[:, rank * cols:(rank + 1) * cols])


def test_qkv_layer_places_packed_parts_and_refuses_a_split_inside_an_element():
    q, k, v = _ints(32, 64 // 8, seed=1), _ints(32, 32 // 8, seed=2), _ints(32, 32 // 8, seed=3)
    layer = QKVParallelLinear(32, 16, 4, 2, False, _PackedColumns())
    for shard_id, tensor in zip("qkv", (q, k, v)):
        layer.qweight.weight_loader(layer.qweight, tensor, shard_id)
    assert torch.equal(layer.qweight.data, torch.cat([q, k, v], dim=1))
    # head_dim 4, one KV head: k is 4 outputs, half an int32.
    odd = QKVParallelLinear(32, 4, 4, 1, False, _PackedColumns())
    with pytest.raises(ValueError, match="whole packed elements"):
        odd.qweight.weight_loader(odd.qweight, _ints(32, 1, seed=4), "k")
