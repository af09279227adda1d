"""Latent attention's up-projection ``kv_b_proj``: each latent into every head's unrotated key part and
value. Prefill multiplies by its weight as loaded; absorbed decode multiplies by its halves per head,
W_UK (the query into latent space) and W_UV (the latent output back to each head's value).

``torch.bmm`` over the heads, those halves being strided views of the loaded weight, spent ~1.5 ms per
layer at one to 32 decode rows on DeepSeek-V3's heads divided by 4 (32 heads, 128 x 512 each; 2
threads; both products, the fastest of 100-200 calls on a machine at load 5-9), whatever the rows.
On bf16 CPU weights this method therefore keeps a copy of both halves, one contiguous matrix per head,
for the few-row experts kernel (bf16_linear.c's ``experts`` entry, each head an "expert"), which
multiplies every head in one call: 0.17 ms at one row, 0.55 ms at 8, 1.08 ms at 16, 2.1 ms at 32 (one
weight load per 4 rows of a head), so it serves up to 16 rows. ``benchmarks/latent_decode.py`` times
the whole decode attention of a layer both ways. The copy costs the weight's bytes again (DeepSeek-V3: 32 MiB a layer,
0.15% of its weights)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.kernels import ops
from octavo.kernels.bf16_linear import Bf16LinearKernel, bf16_linear_kernel
from octavo.quant.base import LinearMethod, PreparedWeight
from octavo.quant.unquantized import UnquantizedLinearMethod

# Decode rows up to which the per-head products go through the experts kernel (above: torch.bmm).
HEAD_KERNEL_ROWS = 16


@dataclass(frozen=True)
class HeadProducts:
    """kv_b_proj's halves per head, contiguous, as the experts kernel reads them."""

    keys: torch.Tensor  # W_UK transposed [heads, kv_lora_rank, nope]: q_nope -> the query's latent
    values: torch.Tensor  # W_UV [heads, v, kv_lora_rank]: the latent output -> each head's value
    kernel: Bf16LinearKernel
    head_ids: tuple[torch.Tensor, ...]  # [rows]: each head's index repeated ``rows`` times, rows 1..HEAD_KERNEL_ROWS

    def multiply(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [rows, heads, in] (rows <= HEAD_KERNEL_ROWS), row r of head h times ``weights[h]`` [out, in]^T
        -> [rows, heads, out]."""
        rows, heads, width = x.shape
        by_head = x.transpose(0, 1).reshape(heads * rows, width)  # one head's rows next to each other
        out = ops.call(self.kernel.experts, torch.ops.octavo.bf16_linear_experts, by_head, weights,
                       self.head_ids[rows - 1])
        return out.view(heads, rows, -1).transpose(0, 1)


class LatentUpProjectionMethod(UnquantizedLinearMethod):
    """kv_b_proj's weight as loaded (plain float: decode reads its halves as they are stored), plus the
    per-head copies of ``HeadProducts`` where the experts kernel runs (bf16 on a CPU): the layer's
    ``prepared``, None elsewhere."""

    def __init__(self, nope_dim: int, v_dim: int) -> None:
        super().__init__()
        self.nope_dim, self.v_dim = nope_dim, v_dim

    def process_weights_after_loading(self, layer: nn.Module) -> Optional[PreparedWeight]:
        weight = layer.weight.detach()
        kernel = bf16_linear_kernel()
        if kernel is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return None
        heads = weight.shape[0] // (self.nope_dim + self.v_dim)
        by_head = weight.view(heads, self.nope_dim + self.v_dim, weight.shape[1])
        head_ids = tuple(torch.arange(heads).repeat_interleave(rows) for rows in range(1, HEAD_KERNEL_ROWS + 1))
        return PreparedWeight(HeadProducts(by_head[:, : self.nope_dim].transpose(1, 2).contiguous(),
                                           by_head[:, self.nope_dim :].contiguous(), kernel, head_ids))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def kernel_name(self, layer: nn.Module) -> str:
        return "torch" if layer.prepared is None else f"torch + per-head copies (<= {HEAD_KERNEL_ROWS} decode rows)"

    def weight_bytes(self, layer: nn.Module) -> int:
        heads: Optional[HeadProducts] = layer.prepared
        copies = 0 if heads is None else heads.keys.nbytes + heads.values.nbytes
        return LinearMethod.weight_bytes(self, layer) + copies
