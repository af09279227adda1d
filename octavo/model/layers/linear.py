"""Linear layers split Megatron-style across the tensor-parallel ranks, each
parameter loading its own shard from the full checkpoint tensor.

Column-parallel layers split the output features (every rank computes a
slice of the outputs: q/k/v heads, gate/up columns); row-parallel ones split
the input features (every rank computes a partial sum, all-reduced). An
attention or MLP block is a column-parallel layer followed by a row-parallel
one, so each needs one all-reduce and nothing in between. At tp_size 1 every
split is the whole tensor and no collective runs.

What the weight is (bf16, quantized, prepacked) and which kernel multiplies
it is the layer's ``LinearMethod``'s business (octavo/quant/).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Union

import torch
from torch import nn

from octavo.distributed.communication import tensor_model_parallel_all_reduce
from octavo.distributed.parallel_state import get_parallel_state
from octavo.quant.base import LinearMethod, LinearWeightHolder, set_weight_attrs
from octavo.quant.unquantized import UnquantizedLinearMethod


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


def load_shard(target: torch.Tensor, loaded: torch.Tensor, dim: Optional[int], index: int, num_shards: int) -> None:
    """Copy piece ``index`` of ``loaded`` cut into ``num_shards`` equal pieces
    along ``dim`` (each the size of ``target``) into ``target``; dim None: the
    whole tensor. ValueError when ``loaded`` is not the full tensor's shape."""
    expected = list(target.shape)
    if dim is not None:
        expected[dim] *= num_shards
    if list(loaded.shape) != expected:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {tuple(expected)}")
    if dim is not None:
        loaded = loaded.narrow(dim, index * target.shape[dim], target.shape[dim])
    target.copy_(loaded)


def output_part(param: nn.Parameter, offset: int, size: int, data: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The slice of ``param`` along its output dim holding outputs ``offset``
    .. ``offset + size`` of this rank's shard, in the parameter's own units
    (``pack_factor`` outputs per element along a packed output dim).
    ``data``: the part of ``param`` to cut instead of all of it (one expert
    of a mixture's stacked parameter), its dims as the parameter's attributes count them."""
    dim = param.output_dim
    if getattr(param, "packed_dim", None) == dim:
        factor = param.pack_factor
        if offset % factor or size % factor:
            raise ValueError(f"part of {size} outputs at {offset} does not fall on whole packed elements "
                             f"of {factor}")
        offset, size = offset // factor, size // factor
    return (param.data if data is None else data).narrow(dim, offset, size)


def load_unsplit(param: nn.Parameter, loaded: torch.Tensor, part: int, data: Optional[torch.Tensor] = None) -> None:
    """A fused layer's parameter not split along the outputs: one tensor for
    the whole layer (a per-layer scale), or, when the parameter says
    ``per_part``, row ``part`` of it (each part's own copy, e.g. GPTQ's
    g_idx, which the method checks agree). ``data``: as for ``output_part``."""
    data = param.data if data is None else data
    load_shard(data[part] if getattr(param, "per_part", False) else data, loaded, None, 0, 1)


class LinearBase(LinearWeightHolder, ABC):
    """This rank's ``input_size`` x ``sum(output_sizes)`` product: the weight
    is created by ``linear_method``, the bias (``bias_split``: sharded along
    the outputs, else whole) here, and every parameter gets ``weight_loader``.
    ``prefix``: the layer's module path in the checkpoint (for messages; the
    model picked ``linear_method`` by it)."""

    # Equal slices of the checkpoint's input features the layer's inputs are
    # one of (row-parallel: tp_size), for methods whose tensors span all of
    # them (act-order scales).
    input_shards = 1

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        bias_split: bool,
        linear_method: Optional[LinearMethod],
        prefix: str,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.output_sizes = output_sizes
        dtype = torch.get_default_dtype()
        self.linear_method.create_weights(self, input_size, output_sizes, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0 if bias_split else None, input_dim=None)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    @abstractmethod
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's part of the full checkpoint tensor ``loaded`` into ``param``."""


class ReplicatedLinear(LinearBase):
    """The whole product on every rank (a mixture of experts' router: small, and every rank needs all
    of its outputs); no collective."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 linear_method: Optional[LinearMethod] = None, prefix: str = "") -> None:
        super().__init__(input_size, [output_size], bias, False, linear_method, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_shard(param.data, loaded, None, 0, 1)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no collective (the next
    row-parallel layer consumes the split)."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 linear_method: Optional[LinearMethod] = None, prefix: str = "") -> None:
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        super().__init__(input_size, self._rank_sizes(output_size), bias, True, linear_method, prefix)

    def _rank_sizes(self, output_size: int) -> list[int]:
        return [divide(output_size, self.tp_size, "output features")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_shard(param.data, loaded, param.output_dim, self.tp_rank, self.tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel products of one input as one matmul (gate/up):
    each rank holds its slice of every part, parts in order. The checkpoint
    stores the parts apart; ``shard_id`` is the part's index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 linear_method: Optional[LinearMethod] = None, prefix: str = "") -> None:
        self.full_output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, linear_method, prefix)

    def _rank_sizes(self, output_size: int) -> list[int]:
        return [divide(size, self.tp_size, "output features") for size in self.full_output_sizes]

    def checkpoint_parts(self) -> list[tuple[Union[int, str], int]]:
        """(shard id, output features) of each part of the full fused tensor, in order."""
        return list(enumerate(self.full_output_sizes))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Union[int, str, None] = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be a part index in [0, {len(self.output_sizes)}); got {shard_id!r}")
        if param.output_dim is None:
            load_unsplit(param, loaded, shard_id)
            return
        offset, size = sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]
        load_shard(output_part(param, offset, size), loaded, param.output_dim, self.tp_rank, self.tp_size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matmul, split by heads. With fewer KV
    heads than ranks each KV head is replicated on tp_size / num_kv_heads
    ranks (every rank needs the K/V of its query heads' group)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 linear_method: Optional[LinearMethod] = None, prefix: str = "") -> None:
        tp_size = get_parallel_state().tp_size
        self.head_dim = head_dim
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        if tp_size >= num_kv_heads:
            if tp_size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of num_key_value_heads "
                                 f"{num_kv_heads} (each KV head must be replicated on the same number of ranks)")
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
        self.num_kv_shards = num_kv_heads // self.num_kv_heads
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias, linear_method,
                         prefix)

    def _rank_sizes(self, output_size: int) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def checkpoint_parts(self) -> list[tuple[Union[int, str], int]]:
        """(shard id, output features) of q, k and v in the full fused tensor."""
        kv = self.total_kv_heads * self.head_dim
        return [("q", self.total_heads * self.head_dim), ("k", kv), ("v", kv)]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Union[int, str, None] = None) -> None:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v'; got {shard_id!r}")
        if param.output_dim is None:
            load_unsplit(param, loaded, "qkv".index(shard_id))
            return
        q, kv = self.output_sizes[0], self.output_sizes[1]
        if shard_id == "q":
            offset, size, index, shards = 0, q, self.tp_rank, self.tp_size
        else:
            # Ranks tp_size / num_kv_shards apart in a row share one KV shard.
            index = self.tp_rank * self.num_kv_shards // self.tp_size
            offset, size, shards = q if shard_id == "k" else q + kv, kv, self.num_kv_shards
        load_shard(output_part(param, offset, size), loaded, param.output_dim, index, shards)


class RowParallelLinear(LinearBase):
    """Input features split across ranks: each rank multiplies its slice of
    the input (the previous column-parallel layer's output) and the partial
    sums are all-reduced. The bias is added by rank 0 only, fused into its
    product, so the sum holds it once."""

    # Each rank holds a slice of every weight row (a quantizer that scales
    # whole rows must agree with the other ranks on them).
    splits_input = True

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 linear_method: Optional[LinearMethod] = None, prefix: str = "") -> None:
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.input_shards = self.tp_size
        super().__init__(divide(input_size, self.tp_size, "input features"), [output_size], bias, False,
                         linear_method, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_shard(param.data, loaded, param.input_dim, self.tp_rank, self.tp_size)
