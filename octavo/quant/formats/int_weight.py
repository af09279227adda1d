"""The one form every pre-quantized format is unpacked into, and that the
kernels' packers take: unsigned integers, one scale and one zero point per
group of input features, groups contiguous.

``W[n, perm[k]] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]``

or, for formats that store a float offset per group instead of a zero point
(GGUF's Q4_1: ``w = d * q + m``), ``q * scales + mins`` with ``zeros`` None.
Such an offset is kept as it is: turning it into a zero point ``-m / d``
would round it (and has no value where ``d`` is 0).

Act-order checkpoints (GPTQ ``desc_act``, compressed-tensors ``actorder:
group``) quantize the input features in order of decreasing activation
size, so a group's features are scattered over the row and ``g_idx`` says
which group each belongs to. Sorting the columns by group makes the groups
contiguous again (``perm``); the layer then gathers its input columns in
that order, ``x[:, perm]``, once per product. That gather reads the
activations once (K values per row): for a decode row it is ~1/N of the
weight read it saves a group-index lookup from, so the int4 kernel stays
the plain group-wise one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class IntWeight:
    q: torch.Tensor  # uint8 [N, K], values 0 .. 2**bits - 1, columns in kernel order
    scales: torch.Tensor  # float [N, G]
    zeros: Optional[torch.Tensor]  # int32 [N, G]; a GPTQ v1 zero may be 2**bits (see gptq.py); None: mins
    bits: int
    group_size: int  # columns per group; K for one scale per row
    perm: Optional[torch.Tensor] = None  # int64 [K]: column k is input feature perm[k]; None: identity
    mins: Optional[torch.Tensor] = None  # float [N, G] offsets added to q * scales, where zeros is None

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide the {k} input features")
        if (self.zeros is None) == (self.mins is None):
            raise ValueError("an IntWeight has either zero points or offsets (mins), one of the two")
        groups = k // self.group_size
        for name in ("scales", "zeros" if self.mins is None else "mins"):
            shape = tuple(getattr(self, name).shape)
            if shape != (n, groups):
                raise ValueError(f"{name} has shape {shape}; expected {(n, groups)} for {k} input features "
                                 f"in groups of {self.group_size}")

    @property
    def symmetric_zero(self) -> Optional[int]:
        """The zero point when every group has the mid-range one (2**(bits-1)), else None."""
        mid = 1 << (self.bits - 1)
        return mid if self.zeros is not None and bool((self.zeros == mid).all()) else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in the input features' own order, in ``dtype``."""
        expand = lambda t: t.repeat_interleave(self.group_size, dim=1)  # noqa: E731
        scales = expand(self.scales.to(torch.float32))
        if self.mins is None:
            w = (self.q - expand(self.zeros)).to(torch.float32) * scales
        else:
            w = self.q.to(torch.float32) * scales + expand(self.mins.to(torch.float32))
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)


def with_group_index(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, group_size: int, bits: int
) -> IntWeight:
    """An IntWeight from columns tagged by group: ``q`` [N, K] with column k
    in group ``g_idx[k]`` of ``scales``/``zeros`` [N, G_all] (G_all may
    count groups of other ranks' columns). Columns are sorted by group when
    they are not in order already. Where a group present is not whole
    (``group_size`` columns), the result has one group per column."""
    g_idx = g_idx.to(torch.int64)
    if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= scales.shape[1]):
        raise ValueError(f"g_idx has group indices outside [0, {scales.shape[1]})")
    perm, sorted_q, sorted_idx = None, q, g_idx
    if bool((g_idx[1:] < g_idx[:-1]).any()):
        perm = torch.argsort(g_idx, stable=True)
        sorted_q, sorted_idx = q[:, perm], g_idx[perm]
    groups, counts = torch.unique_consecutive(sorted_idx, return_counts=True)
    # One group holding all columns is a per-row scale, whatever group_size says.
    size = q.shape[1] if len(groups) == 1 else group_size
    if bool((counts != size).any()):
        # Some group is split with another rank (act-order under tensor
        # parallelism): no group-wise kernel runs that, so each column keeps
        # its own group's scale and zero point (group_size 1: dequantized).
        return IntWeight(q, scales[:, g_idx], zeros[:, g_idx], bits, 1)
    return IntWeight(sorted_q, scales[:, groups], zeros[:, groups], bits, size, perm)
