"""How layers form KV cache groups: one group per kind of layer when the kinds are equally many, the more
numerous kind split into groups of the rarer kind's size, and layer j of each group on slot j."""
from __future__ import annotations

from octavo.attention.kv_groups import group_layers


def test_one_kind_of_layer_is_one_group():
    assert group_layers([None] * 4).layers == ((0, 1, 2, 3),)
    mistral = group_layers([32] * 3)
    assert mistral.windows == (32,) and mistral.layers == ((0, 1, 2),)


def test_alternating_layers_share_slots_pairwise():
    gemma2 = group_layers([8, None, 8, None])
    assert gemma2.windows == (8, None) and gemma2.layers == ((0, 2), (1, 3))
    assert [gemma2.slot_of(layer) for layer in range(4)] == [0, 0, 1, 1]
    assert [gemma2.group_of(layer) for layer in range(4)] == [0, 1, 0, 1]


def test_the_more_numerous_kind_splits_into_groups_of_the_rarer_size():
    # Qwen2 with max_window_layers=5 of 7: five global layers, two sliding ones.
    qwen2 = group_layers([None] * 5 + [48] * 2)
    assert qwen2.windows == (None, None, None, 48)
    assert qwen2.layers == ((0, 1), (2, 3), (4,), (5, 6))
    assert qwen2.slot_of(4) == 0 and qwen2.slot_of(6) == 1
