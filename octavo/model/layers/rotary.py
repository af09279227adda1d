"""Rotary position embeddings, with the scaling variants of Hugging Face configs.

The inverse frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` so that
logits match the reference implementation."""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from octavo.model.config import RopeConfig

logger = logging.getLogger(__name__)


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many leading dims of each head are rotated."""
    return int(head_dim * rope.partial_rotary_factor)


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_len: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention factor scaling cos/sin);
    ``head_dim``: the rotated dims (``rotary_dim``).

    Built on the CPU explicitly: the model is constructed under its device's
    context for loading, and ``cos_sin`` moves them where the positions are."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        return _dynamic(rope, head_dim, exponents, max_len), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    if rope.rope_type == "longrope":
        return _longrope(rope, exponents, max_len), float(rope.attention_factor)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def _dynamic(rope: RopeConfig, head_dim: int, exponents: torch.Tensor, max_len: int) -> torch.Tensor:
    # NTK-aware scaling grows the base with the context. transformers grows it
    # with the longest sequence seen so far; a serving engine needs positions to
    # mean the same thing in every batch, so the base is fixed for the engine's
    # max_model_len (it equals the plain base within the trained context).
    trained = rope.original_max_position_embeddings or max_len
    seq_len = max(max_len, trained)
    base = rope.theta * ((rope.factor * seq_len / trained) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base**exponents)


def _longrope(rope: RopeConfig, exponents: torch.Tensor, max_len: int) -> torch.Tensor:
    # transformers picks the short or the long factors per forward, by the
    # longest position in it, so one sequence's early keys can be rotated
    # with other factors than its later queries. Here, as for "dynamic", the
    # choice is made once for the engine's max_model_len: positions mean the
    # same in every batch, and a sequence scored in one pass gets exactly
    # transformers' numbers (short factors within the trained context).
    long = max_len > rope.original_max_position_embeddings
    factors = rope.long_factor if long else rope.short_factor
    if len(factors) != exponents.numel():
        which = "long_factor" if long else "short_factor"
        raise ValueError(f"rope scaling 'longrope': {which} has {len(factors)} entries, the rotated head dims "
                         f"need {exponents.numel()}")
    logger.info("longrope: %s factors for max_model_len %d (trained context %d)", "long" if long else "short",
                max_len, rope.original_max_position_embeddings)
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext * rope.theta**exponents)


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    factor, base, old_len = rope.factor, rope.theta, rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolation = 1.0 - ramp  # 1 for high-frequency dims: keep them as trained
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


# The most bytes the cos and sin tables of every position may take together (a 32k context of 128 rotated
# dims in bf16); a longer context computes each step's cos/sin instead.
TABLE_MAX_BYTES = 16 * 2**20


class RotaryEmbedding:
    """cos/sin for the step's positions are looked up (or computed) once per forward and
    shared by every layer (``cos_sin``), then applied per layer (``apply``)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int) -> None:
        self.rotary_dim = rotary_dim(rope, head_dim)
        self.max_len = max_len
        self.inv_freq, self.attention_factor = inverse_frequencies(rope, self.rotary_dim, max_len)
        self._device_inv_freq: Optional[torch.Tensor] = None
        self._tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # cos, sin of positions 0 .. max_len - 1

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions (below ``max_len``) -> cos, sin of shape [T, 1, rotary_dim] (broadcast over heads).
        Looked up in tables of every position where they fit ``TABLE_MAX_BYTES``: computing them is nine small
        ops a forward, which a kernel tape replays one by one (a sixth of a speculative draft's decode forward
        on Zen 4); the tables hold the same values, each element being computed alike."""
        tables = self._tables
        if tables is None or tables[0].device != positions.device or tables[0].dtype != dtype:
            if 2 * self.max_len * self.rotary_dim * dtype.itemsize > TABLE_MAX_BYTES:
                return self._compute(positions, dtype)
            tables = self._tables = self._compute(torch.arange(self.max_len, device=positions.device), dtype)
        return tables[0].index_select(0, positions), tables[1].index_select(0, positions)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._device_inv_freq
        if inv_freq is None or inv_freq.device != positions.device:
            inv_freq = self._device_inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by the half-split convention, over
        its first cos.shape[-1] dims (the rest pass through: partial rotary)."""
        dim = cos.shape[-1]
        if dim < x.shape[-1]:
            return torch.cat((RotaryEmbedding.apply(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, dim] rotated with its dims paired as (0, 1), (2, 3) ... (DeepSeek). The result
        comes out with each pair's first members, then their second ones: the order of the half-split
        convention. Attention reads rotated vectors only through dot products of a query and a key
        both laid out so, which no order of the dims changes."""
        return RotaryEmbedding.apply(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)
