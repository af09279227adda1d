"""KV events from the KV cache manager: what a router outside the engine sees."""
from __future__ import annotations

from core_harness import make_request

from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.prefix_hash import extend_block_hashes
from octavo.kv_events import BlockRemoved, BlockStored, decode_batch, encode_batch


def _compute(kv: KVCacheManager, req, n: int) -> None:
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_blocks(req)


def test_no_events_unless_enabled():
    kv = KVCacheManager(8, 4)
    _compute(kv, make_request("a", 12), 12)
    assert kv.take_events() == [] and kv.pool.events is None


def test_stored_blocks_carry_the_prefix_cache_hashes_and_evictions_are_removed():
    kv = KVCacheManager(4, 4)
    kv.enable_events()
    a = make_request("a", 10)
    _compute(kv, a, 6)  # one full block
    _compute(kv, a, 4)  # the second
    expected: list[bytes] = []
    extend_block_hashes(expected, a.all_token_ids, 4, 2)
    events = kv.take_events()
    assert events == [
        BlockStored([expected[0]], None, list(a.all_token_ids[:4]), 4),
        BlockStored([expected[1]], expected[0], list(a.all_token_ids[4:8]), 4),
    ]
    assert kv.take_events() == []  # taken once
    kv.free(a)
    # A new request needing every block evicts both cached ones.
    _compute(kv, make_request("b", 13), 13)
    removed = [h for e in kv.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(expected)


def test_batches_round_trip_through_the_wire_format():
    kv = KVCacheManager(8, 4)
    kv.enable_events()
    _compute(kv, make_request("a", 9), 9)
    events = kv.take_events()
    seq, batch = decode_batch(encode_batch(events, 41))
    assert seq == 41 and batch.events == events
    assert isinstance(events[0], BlockStored) and len(events[0].block_hashes) == 2  # one run, one event
