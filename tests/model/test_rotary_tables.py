"""Rotary cos/sin looked up in per-position tables: the values computing them gives, bit for bit, and a kernel
tape's replay of the lookup follows its positions."""
from __future__ import annotations

import pytest
import torch

from octavo.model.config import RopeConfig
from octavo.model.layers import rotary
from octavo.model.layers.rotary import RotaryEmbedding
from octavo.worker.kernel_tape import record_tape

MAX_LEN = 4096
ROPES = {
    "default": RopeConfig(),
    "yarn": RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),  # attention factor
    "partial": RopeConfig(theta=500000.0, partial_rotary_factor=0.5),
}


def computed(rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos/sin as a forward computed them before the tables: from the step's positions alone."""
    freqs = positions.float().unsqueeze(-1) * rope.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * rope.attention_factor).to(dtype).unsqueeze(1),
            (emb.sin() * rope.attention_factor).to(dtype).unsqueeze(1))


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_table_lookup_equals_computing_every_position(name, dtype):
    rope = RotaryEmbedding(ROPES[name], 128, MAX_LEN)
    generator = torch.Generator().manual_seed(0)
    for length in (1, 3, 64):
        for start in [0, MAX_LEN - length, *torch.randint(0, MAX_LEN - length, (8,), generator=generator).tolist()]:
            positions = torch.arange(start, start + length)
            got = rope.cos_sin(positions, dtype)
            want = computed(rope, positions, dtype)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (name, dtype, start, length)
            assert got[0].shape == (length, 1, rope.rotary_dim) and got[0].is_contiguous()
    assert rope._tables is not None


def test_a_context_past_the_table_budget_computes_instead(monkeypatch):
    monkeypatch.setattr(rotary, "TABLE_MAX_BYTES", 2 * MAX_LEN * 128 * 2 - 1)  # one byte short for bf16
    rope = RotaryEmbedding(ROPES["default"], 128, MAX_LEN)
    positions = torch.tensor([0, 17, MAX_LEN - 1])
    got = rope.cos_sin(positions, torch.bfloat16)
    assert rope._tables is None
    assert all(torch.equal(g, w) for g, w in zip(got, computed(rope, positions, torch.bfloat16)))


def test_a_recorded_lookup_replays_with_the_new_positions():
    rope = RotaryEmbedding(ROPES["default"], 64, MAX_LEN)
    positions = torch.tensor([5, 9])
    rope.cos_sin(positions, torch.bfloat16)  # the tables are made on a first, eager forward
    with torch.inference_mode():
        tape, (cos, sin) = record_tape(lambda: rope.cos_sin(positions, torch.bfloat16))
        assert tape.num_torch_ops == 2  # one lookup each, where computing them recorded nine ops
        positions.copy_(torch.tensor([1000, 4095]))
        tape.replay()
    want = computed(rope, positions, torch.bfloat16)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
