"""The tests' torch reference of the rounding Octavo's int8 activations use
at few rows: llama.cpp's Q8_0 (its reference quantize_row_q8_0), per block
of 32 values of a row: d = max|x| / 127 kept as float16, q = x * (1 / d)
rounded half away from zero (0 for an all-zero block)."""
from __future__ import annotations

from typing import Iterable

import torch


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: the integer part, plus one away from zero where the fraction is >= 0.5."""
    whole = torch.trunc(v)
    return whole + torch.where((v - whole).abs() >= 0.5, torch.sign(v), torch.zeros_like(v))


def round_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> (q [..., K] float32 integers, d [..., K/32] float32 of float16 values)."""
    blocks = x.float().unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = round_half_away(blocks * inverse.unsqueeze(-1))
    return q.flatten(-2), d.half().float()


def q8_0_values(x: torch.Tensor) -> torch.Tensor:
    """The numbers the integer products multiply in place of x: q * d, in x's dtype."""
    q, d = round_q8_0(x)
    return (q.unflatten(-1, (-1, 32)) * d.unsqueeze(-1)).flatten(-2).to(x.dtype)


def round_linear_inputs(model: torch.nn.Module, skip: Iterable[str] = ("lm_head",)) -> None:
    """Every nn.Linear of ``model`` but those named in ``skip`` rounds its input as Octavo's int8 activations do."""
    skipped = tuple(skip)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(skipped):
            module.register_forward_pre_hook(lambda _m, args: (q8_0_values(args[0]),))
